"""Prompt logprobs (engine/prompt_logprobs.py): every prompt token's logprob, rank and top-k
equal HF transformers' log-softmax over its logits, across chunked prefill, with prefix caching
bypassed, in every output kind."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # a 16-token budget chunks the 40-token prompt into three steps
    return LLM(tiny_llama_dir, device="cpu", kv_cache_memory=8 << 20, max_num_batched_tokens=16,
               max_model_len=256)


def _hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]


def test_prompt_logprobs_equal_hf_across_chunks_and_cache_hits(llm, tiny_llama_dir):
    ids = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)  # cached prefix
    ref = _hf_logprobs(tiny_llama_dir, ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p, entry in enumerate(out.prompt_logprobs[1:]):
        target = ids[p + 1]
        expect = ref[p]
        assert entry[target].logprob == pytest.approx(expect[target].item(), abs=1e-4)
        assert entry[target].rank == int((expect > expect[target]).sum()) + 1
        top = expect.topk(3).indices.tolist()
        assert set(top) <= set(entry)
        assert [entry[t].rank for t in top] == [1, 2, 3]
        assert all(math.isfinite(lp.logprob) for lp in entry.values())


def test_prompt_logprobs_zero_gives_the_prompt_tokens_only_once_in_delta_mode(llm):
    ids = list(range(200, 221))
    params = SamplingParams(max_tokens=4, prompt_logprobs=0, output_kind="delta",
                            ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("d", {"prompt_token_ids": ids}["prompt_token_ids"], params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    with_lp = [p for p in seen if p is not None]
    assert len(with_lp) == 1
    assert [list(d) for d in with_lp[0][1:]] == [[t] for t in ids[1:]]


def test_bad_prompt_logprobs_is_a_value_error():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
