"""The engine on the Triton attention backend: greedy output equals HF transformers through
mixed prefill/decode steps, chunked prefill and prefix-cache hits.

On CPU the kernels run in Triton's interpreter (a tiny model, few tokens); on a GPU the same test
runs on CUDA (fp32, so agreement must be exact)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve import LLM, SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_triton_backend_matches_hf_with_chunked_prefill_and_prefix_hits(
    tiny_llama_dir, hf_tiny, hf_oracle, monkeypatch
):
    import engine.attention.triton_backend as backend_module

    fused: list[int] = []  # rotary and KV store as one kernel, on CPU too (the interpreter)
    real = backend_module.rope_and_store
    monkeypatch.setattr(backend_module, "rope_and_store",
                        lambda *args: fused.append(1) or real(*args))
    llm = LLM(tiny_llama_dir, dtype="float32", device=DEVICE, attention_backend="triton",
              max_num_batched_tokens=24, max_num_seqs=4, num_kv_blocks=64, seed=0)
    assert llm.llm_engine.runner.backend.name == "triton"
    shared = list(range(100, 134))  # 34 tokens: two full blocks shared by two prompts
    prompts = [shared + [7, 8, 9], [5, 6, 7, 8, 9, 10], shared + [11], list(range(300, 319))]
    max_tokens = 6 if DEVICE == "cpu" else 24
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    expected = hf_oracle(hf_tiny, prompts, max_tokens, llm.llm_engine.eos_token_ids)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert fused
    stats = llm.llm_engine.scheduler.block_manager
    assert stats.prefix_cache_hits > 0  # the third prompt reused the first one's blocks


def test_triton_backend_with_merged_decode_splits_matches_hf(tiny_llama_dir, hf_tiny, hf_oracle,
                                                             monkeypatch):
    """The one-launch decode (splits merged in the kernel), forced to 3 splits even on a CPU."""
    import functools

    import engine.attention.triton_backend as backend_module

    monkeypatch.setattr(backend_module, "default_num_splits", lambda *args: 3)
    monkeypatch.setattr(backend_module, "TritonAttentionBackend", functools.partial(
        backend_module.TritonAttentionBackend, merged_decode=True))
    merged: list[int] = []
    real = backend_module.paged_decode_attention_merged
    monkeypatch.setattr(backend_module, "paged_decode_attention_merged",
                        lambda *args, **kwargs: merged.append(1) or real(*args, **kwargs))
    llm = LLM(tiny_llama_dir, dtype="float32", device=DEVICE, attention_backend="triton",
              max_num_seqs=4, num_kv_blocks=64, seed=0)
    prompts = [list(range(100, 137)), [5, 6, 7, 8, 9, 10], list(range(300, 319))]
    max_tokens = 6 if DEVICE == "cpu" else 24
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    expected = hf_oracle(hf_tiny, prompts, max_tokens, llm.llm_engine.eos_token_ids)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert merged
