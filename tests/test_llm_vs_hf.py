"""End-to-end truth: greedy output equals HF transformers token for token, whatever the batching."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "In machine learning, a transformer is a neural network architecture that relies on "
    "self-attention. Unlike recurrent networks, it processes all the tokens of a sequence at "
    "once, which makes training on long documents much faster. Explain why:",
    "Hello",
    "Translate to French: The weather is nice today.",
]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi!"}],
]


def token_ids(out) -> list[int]:
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def bundled_llm():
    return LLM(dtype="float32", max_model_len=1024, seed=0)


@pytest.mark.slow
def test_bundled_model_matches_hf_in_one_batch(bundled_llm, bundled_hf_model, hf_oracle):
    tok = bundled_llm.get_tokenizer()
    chat_ids = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False)
                for c in CHATS]
    prompts = [tok.encode(p) for p in PROMPTS] + [list(c) for c in chat_ids]
    outs = bundled_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_32,
                                use_tqdm=False)
    eos = bundled_llm.llm_engine.eos_token_ids
    expected = hf_oracle(bundled_hf_model, prompts, 32, eos)
    assert [token_ids(o) for o in outs] == expected
    for o, exp in zip(outs, expected):
        assert o.outputs[0].text == tok.decode(exp, skip_special_tokens=True)
        assert o.outputs[0].finish_reason == ("stop" if exp[-1] in eos else "length")


@pytest.mark.slow
def test_bundled_chat_api_matches_generate(bundled_llm):
    one = bundled_llm.chat(CHATS[0], GREEDY_32, use_tqdm=False)
    assert len(one) == 1
    tok = bundled_llm.get_tokenizer()
    ids = tok.apply_chat_template(CHATS[0], add_generation_prompt=True, return_dict=False)
    direct = bundled_llm.generate({"prompt_token_ids": list(ids)}, GREEDY_32, use_tqdm=False)
    assert token_ids(one[0]) == token_ids(direct[0])
    assert one[0].outputs[0].text.strip()


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tiny_random_models_match_hf(model_dir, request, hf_oracle):
    from engine.model_loader import load_hf_model

    path = request.getfixturevalue(model_dir)
    llm = LLM(path, dtype="float32", seed=0)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    hf = load_hf_model(path, __import__("torch").float32)
    expected = hf_oracle(hf, prompts, 24, llm.llm_engine.eos_token_ids)
    assert [token_ids(o) for o in outs] == expected
