"""Speculative decoding with a draft model: exact greedy output whatever the draft (itself:
every draft accepted; a random other model: few), under preemption, seeded sampling, and on a
decode worker of the disaggregated pipeline."""

from __future__ import annotations

import pytest
import torch
from test_disagg_engine import disaggregated, run_all
from test_spec_decode import verify_every_draft

from engine.llm import LLM, build_engine_config
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = [[1, 17, 230, 58, 901, 44, 12, 7], [1, 505, 13, 99, 1000, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                               13, 14, 15, 16, 17], [1, 3], [1, 640, 641, 642]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, bundled_tokenizer) -> str:
    """A random draft of another family and shape, on the same tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=len(bundled_tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      initializer_range=0.2)
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("draft")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    bundled_tokenizer.save_pretrained(path)
    return str(path)


def make(path: str, draft: str | None, k: int = 3, **kwargs) -> LLM:
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": k}
    kwargs.setdefault("kv_cache_memory", 16 << 20)
    kwargs.setdefault("max_model_len", 256)
    return verify_every_draft(LLM(path, dtype="float32", device="cpu", speculative_config=spec,
                                  **kwargs))


def tokens(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make(tiny_llama_dir, None)


@pytest.mark.parametrize("k", [1, 4])
def test_the_target_as_its_own_draft_accepts_everything(tiny_llama_dir, plain, k):
    llm = make(tiny_llama_dir, tiny_llama_dir, k)
    assert llm.llm_engine.config.speculative.method == "draft_model"
    assert tokens(llm) == tokens(plain)
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_random_draft_changes_nothing_but_speed(tiny_llama_dir, other_draft_dir, plain):
    llm = make(tiny_llama_dir, other_draft_dir, 3)
    assert tokens(llm) == tokens(plain)
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens / 2
    # preemption: a cache of 6 blocks of 8 tokens for 4 requests of up to 39 tokens
    small = make(tiny_llama_dir, other_draft_dir, 3, kv_cache_memory=None, num_kv_blocks=6,
                 block_size=8, max_model_len=48)
    assert tokens(small) == tokens(plain)
    assert small.llm_engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_reproducible_with_a_draft(tiny_llama_dir, tiny_qwen2_dir):
    llm = make(tiny_llama_dir, tiny_llama_dir, 3)
    seeded = SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=5, ignore_eos=True)
    alone = tokens(llm, seeded, PROMPTS[:1])
    assert tokens(llm, seeded, PROMPTS)[0] == alone[0]  # whatever the batch


def test_bad_draft_configs_are_refused(tiny_llama_dir, tmp_path, bundled_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft's vocabulary \\(64 tokens\\) differs"):
        make(tiny_llama_dir, str(tmp_path))


def test_a_decode_worker_speculates_with_a_draft(tiny_llama_dir):
    """Prefill on one engine, KV moved, decode with a draft model: equals colocated."""
    def engine(role: str, **kw) -> LLMEngine:
        return verify_every_draft(LLMEngine(build_engine_config(
            tiny_llama_dir, dtype="float32", device="cpu", role=role, **kw)))

    colocated = engine("colocated")
    for i, p in enumerate(PROMPTS):
        colocated.add_request(f"r{i}", p, GREEDY)
    finals = run_all(colocated)
    want = [list(finals[f"r{i}"].outputs[0].token_ids) for i in range(len(PROMPTS))]
    spec = {"model": tiny_llama_dir, "num_speculative_tokens": 3}
    prefill = engine("prefill", speculative_config=spec)
    assert prefill.runner.drafter is None  # the prefill role never drafts
    decode = engine("decode", num_kv_blocks=40, speculative_config=spec)
    decoded = disaggregated(prefill, decode, PROMPTS, GREEDY)
    assert [d[:1] + d[2:] for d in decoded] == want  # drop the imported first token's repeat
    stats = decode.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
