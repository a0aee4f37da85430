"""The model runner's largest step (engine/kv_cache_sizing.py): what sizes the KV cache on CUDA
and, once the cache exists, warms the caching allocator before the first burst of prompts.

It runs over the real cache there, so it must write none of it (every slot -1); on a GPU the
warm-up must leave a full-budget prefill nothing more to allocate."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

CUDA = torch.cuda.is_available()


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32" if not CUDA else "bfloat16",
               device="cuda" if CUDA else "cpu", attention_backend="triton", max_model_len=64,
               max_num_batched_tokens=96, max_num_seqs=4, kv_cache_memory=4 << 20, seed=0,
               **kwargs)


def test_the_largest_step_writes_no_kv(tiny_llama_dir):
    runner = _llm(tiny_llama_dir, enforce_eager=True).llm_engine.runner
    gen = torch.Generator(device=runner.kv_pool.device).manual_seed(0)
    runner.kv_pool.copy_(torch.randn(runner.kv_pool.shape, generator=gen,
                                     device=runner.kv_pool.device).to(runner.kv_pool.dtype))
    before = runner.kv_pool.clone()
    with torch.inference_mode():
        tokens = runner._largest_step(runner.kv_caches)
    assert tokens == 96  # the token budget: one 64-token prompt and one of 32
    assert torch.equal(runner.kv_pool, before)


@pytest.mark.skipif(not CUDA, reason="the caching allocator is CUDA's")
def test_a_full_budget_prefill_allocates_nothing_more(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    prompts = [{"prompt_token_ids": [1 + (i * 5 + j) % 100 for j in range(48)]} for i in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
