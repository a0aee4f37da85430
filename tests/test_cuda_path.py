"""The CUDA path end to end (GPU only; skipped on CPU): Triton kernels, fused ops, CUDA graphs
for decode steps, GPU sampling, the KV cache sized from gpu_memory_utilization.

Correctness against HF transformers: identical greedy tokens in fp32; in bf16, vLLM's
`check_logprobs_close` rule: where the two first disagree, each one's token is among the other's
top-5, and that sequence is not compared further."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from pdserve import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(cuda_llama_dir: str) -> str:
    return cuda_llama_dir


@pytest.fixture(autouse=True)
def _gpu_freed() -> None:
    """Each test sizes its KV cache from the card's free memory: an earlier test's engine, kept
    alive by reference cycles after `del`, would leave it nothing (gpu_memory_utilization is a
    share of the whole card, what other engines hold counted in)."""
    gc.collect()
    torch.cuda.empty_cache()


def prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 300, (n,), generator=gen).tolist()
    return [torch.randint(10, 40000, (m,), generator=gen).tolist() for m in lengths]


def hf_run(model_dir: str, dtype: torch.dtype, batch: list[list[int]]):
    """Greedy tokens and per-step top-5 ids of HF transformers, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    tokens, tops = [], []
    with torch.inference_mode():
        for ids in batch:
            x = torch.tensor([ids], device="cuda")
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(ids):].tolist())
            tops.append([s[0].topk(5).indices.tolist() for s in out.scores])
    del model
    torch.cuda.empty_cache()
    return tokens, tops


def pdserve_run(llm: LLM, batch: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    tops = [[list(step) for step in o.outputs[0].logprobs] for o in outs]
    return tokens, tops


def test_fp32_greedy_identical_to_hf_with_cuda_graphs(model_dir):
    batch = prompts()
    llm = LLM(model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512,
              gpu_memory_utilization=0.3)
    runner = llm.llm_engine.runner
    assert runner.backend.name == "triton" and runner.graphs is not None
    ours, _ = pdserve_run(llm, batch)
    assert runner.graphs.replays > 0  # decode steps went through the captured graphs
    del llm
    torch.cuda.empty_cache()
    theirs, _ = hf_run(model_dir, torch.float32, batch)
    assert ours == theirs


def test_fp32_prompts_replayed_as_decode_rows_identical_to_hf(model_dir, monkeypatch):
    """Graphs of up to 320 rows: every prompt (3-299 tokens, one at a time) is prefilled by a
    replay, its tokens as decode rows (engine/spec_graphs.py, `prefill_rows_fit`)."""
    from engine.cuda_graphs import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "row_keys_max", 1 << 18)
    batch = prompts(6, seed=3)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=320, gpu_memory_utilization=0.3)
    runner = llm.llm_engine.runner
    ours = [pdserve_run(llm, [p])[0][0] for p in batch]
    assert runner.graphs.row_replays >= len(batch)
    del llm
    torch.cuda.empty_cache()
    theirs, _ = hf_run(model_dir, torch.float32, batch)
    assert ours == theirs


def test_bf16_greedy_close_to_hf(model_dir):
    batch = prompts(seed=1)
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.3)
    ours, our_tops = pdserve_run(llm, batch)
    del llm
    torch.cuda.empty_cache()
    theirs, their_tops = hf_run(model_dir, torch.bfloat16, batch)
    agreed = 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreed += first
        if first < len(a):
            assert a[first] in their_tops[i][first], f"seq {i} step {first}: ours not in HF top-5"
            assert b[first] in our_tops[i][first], f"seq {i} step {first}: HF's not in our top-5"
    # A random model's top logits are close, so some divergence is expected; most steps before
    # the first one must still agree (a broken kernel diverges at once).
    assert agreed >= len(batch) * 4, f"only {agreed} tokens agreed before divergence"


def test_kv_cache_takes_the_configured_share_of_the_gpu(model_dir):
    torch.cuda.empty_cache()
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=32, gpu_memory_utilization=0.6)
    runner = llm.llm_engine.runner
    free, total = torch.cuda.mem_get_info()
    used = total - free
    assert used <= 0.6 * total + (256 << 20)
    assert runner.num_blocks * runner.block_bytes() >= 0.3 * total


def test_sampling_needs_one_host_sync_per_step(model_dir):
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=8, gpu_memory_utilization=0.3)
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=3),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                       max_tokens=8, ignore_eos=True),
    ]
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts(4, seed=2), params)):
        engine.add_request(f"r{i}", p, sp)
    engine.step()  # the prefill step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()  # a decode step
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
