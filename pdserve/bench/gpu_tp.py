"""`pdserve bench gpu`, part tp: tensor parallelism on a machine with 2+ GPUs, TP=2 against TP=1
on one random-weight model (gpu_model.py; the Llama-3.2-1B shape, or Llama-3.1-8B's with
`--tp-shape 8b`), bf16 on CUDA and fp32 on the CPU (gloo: `--small --device cpu` checks the code).

  correctness  greedy tokens of 8 seeded prompts of 64-256 tokens, 32 new each, with their top-5
               logprobs: the fraction of requests identical to TP=1's, the mean common prefix,
               and the fraction passing vLLM's `check_logprobs_close` rule (where two greedy
               runs first differ, each one's token is in the other's top 5; after it they may
               diverge: the all-reduce sums bf16 partials in another order)
  latency      batch-1 decode, ms per token (gpu_generation.measure_latency: prompt 128, 256)
  throughput   64 requests of 128-512 prompt and 128 output tokens, output tokens per second;
               and HF transformers' `generate_batch` on the same requests, on GPU 0

NOTE: both sizes run in this process one after the other, each `LLM` shut down (its other ranks
stopped) and its memory given back before the next one loads. Both decode from CUDA graphs
(TP=2's each rank's, holding its NCCL all-reduces), TP=2 eagerly with `--tp-eager`;
`cuda_graphs` says per run which it was. The model is built as gpu_model.RandomModel builds
it, in --model-dir when given (reused as it is: give each --tp-shape its own folder). With
fewer than 2 CUDA GPUs the part is skipped. `--small` ignores `--tp-shape`.
"""

from __future__ import annotations

import dataclasses
import statistics
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.bench.gpu_generation import (
    _run_pdserve,
    _system,
    bench_hf_generate_batch,
    measure_latency,
    subset,
)
from pdserve.bench.gpu_model import (
    SMALL_MODEL,
    ModelShape,
    ModelSizes,
    RandomModel,
    free_device_memory,
    log,
)
from pdserve.bench.throughput import make_workload, match_fraction

SHAPES = {
    "1b": ModelShape(),
    "8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                     intermediate=14336, vocab=128256),
}
TIMEOUT_S = 600.0  # the ranks load their shards of an 8B model before the first collective


@dataclass(frozen=True)
class TPSizes:
    model: ModelSizes = field(default_factory=lambda: ModelSizes(num_requests=64, max_num_seqs=64))
    check_prompts: int = 8
    check_len_range: tuple[int, int] = (64, 256)
    check_tokens: int = 32
    check_logprobs: int = 5


SMALL_TP = TPSizes(model=SMALL_MODEL, check_len_range=(16, 64))


def tp_sizes(small: bool, shape: str) -> TPSizes:
    if small:
        return SMALL_TP
    default = TPSizes()
    return dataclasses.replace(default, model=dataclasses.replace(default.model,
                                                                  shape=SHAPES[shape]))


def measure_tp(
    sizes: TPSizes, device: torch.device, seed: int, model_dir: str | None,
    max_num_batched_tokens: int, use_tqdm: bool, checkpoint: Callable[[dict[str, Any]], None],
    tp_eager: bool = False,
) -> dict[str, Any]:
    """TP=1 then TP=2 on one model (built in `model_dir` unless there), and their comparison.
    Calls `checkpoint(report so far)` after each size's runs; TP=2 failing is reported as
    "error" beside TP=1's figures. `tp_eager`: TP=2 without CUDA graphs."""
    found = torch.cuda.device_count()
    if device.type == "cuda" and found < 2:
        log(f"tp: skipped: needs 2 GPUs, found {found}")
        return {"skipped": f"needs 2 GPUs, found {found}"}
    kwargs = _llm_kwargs(sizes, device, seed, max_num_batched_tokens)
    report: dict[str, Any] = {"dtype": kwargs["dtype"], "runs": {},
                              "shape": dataclasses.asdict(sizes.model.shape)}
    built = RandomModel(sizes.model, device, seed, model_dir, {})  # temporary unless model_dir
    try:
        folder = built.folder
        free_device_memory()  # what building it left cached
        tokens, logprobs = {}, {}
        for tp in (1, 2):
            models = RandomModel(sizes.model, device, seed, folder,
                                 {**kwargs, "tensor_parallel_size": tp,
                                  "enforce_eager": tp_eager and tp > 1})
            try:
                report["runs"][f"tp{tp}"], tokens[tp], logprobs[tp], workload = _one_size(
                    models, tp, sizes, seed, use_tqdm)
                checkpoint(report)  # saved before the shutdown, whatever that does
            except Exception as exc:
                if tp == 1:
                    raise
                traceback.print_exc()
                return {**report, "error": f"TP=2: {type(exc).__name__}: {exc}"}
            finally:
                models.close_llm()  # stops the other ranks, frees the KV cache
        report["hf_generate_batch"] = _hf_generate_batch(folder, workload, sizes, device)
    finally:
        built.remove()
    return {**report, **_compare(report, tokens, logprobs, sizes)}


def _hf_generate_batch(folder: str, workload: Any, sizes: TPSizes,
                       device: torch.device) -> dict[str, Any]:
    """HF transformers' continuous batching on one GPU, the first requests of the
    throughput workload (`hf_cb_requests` of them; bf16, on the CPU fp32)."""
    from engine.model_loader import load_hf_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_hf_model(folder, dtype).to(device)
    part = subset(workload, sizes.model.hf_cb_requests)
    log(f"tp: hf_generate_batch, {len(part.prompts)} requests")
    try:
        return _system(part, bench_hf_generate_batch, model, sizes.model.hf_cb_num_blocks)
    finally:
        del model
        free_device_memory()


def _llm_kwargs(sizes: TPSizes, device: torch.device, seed: int,
                max_num_batched_tokens: int) -> dict[str, Any]:
    kwargs = dict(dtype="bfloat16" if device.type == "cuda" else "float32", device=str(device),
                  seed=seed, max_num_seqs=sizes.model.max_num_seqs,
                  kv_cache_memory=sizes.model.kv_cache_memory, distributed_timeout_s=TIMEOUT_S)
    if max_num_batched_tokens and device.type == "cuda":
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    return kwargs


def _one_size(models: RandomModel, tp: int, sizes: TPSizes, seed: int, use_tqdm: bool
              ) -> tuple[dict[str, Any], list[list[int]], list[list[set[int]]], Any]:
    """Greedy tokens of the correctness prompts (and each position's top logprobs' ids), then
    latency, then throughput (and its workload), on one LLM."""
    from pdserve import SamplingParams

    log(f"tp: TP={tp}")
    llm = models.llm()
    prompts = make_workload(llm.get_tokenizer(), sizes.check_prompts, sizes.check_len_range,
                            (1, 1), seed + 3).prompts
    greedy = SamplingParams(temperature=0, max_tokens=sizes.check_tokens, ignore_eos=True,
                            logprobs=sizes.check_logprobs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    tops = [[set(step) for step in o.outputs[0].logprobs or []] for o in outputs]
    graphs = llm.llm_engine.runner.graphs is not None
    del llm
    latency = measure_latency(models, None, seed)
    workload, throughput = _run_pdserve(models, seed, use_tqdm)[0]
    throughput["input_tokens"] = workload.input_tokens
    return ({"tensor_parallel_size": tp, "cuda_graphs": graphs, "latency": latency,
             "throughput": throughput}, tokens, tops, workload)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def logprobs_close(a: list[int], a_tops: list[set[int]], b: list[int],
                   b_tops: list[set[int]]) -> bool:
    """vLLM's `check_logprobs_close` for one request's two greedy runs: equal up to their first
    difference, and there each run's token among the other run's top logprobs (what follows
    may diverge)."""
    i = common_prefix(a, b)
    if i == min(len(a), len(b)):
        return len(a) == len(b)
    return a[i] in b_tops[i] and b[i] in a_tops[i]


def _compare(report: dict[str, Any], tokens: dict[int, list[list[int]]],
             tops: dict[int, list[list[set[int]]]], sizes: TPSizes) -> dict[str, Any]:
    one, two = report["runs"]["tp1"], report["runs"]["tp2"]
    ones, twos = tokens[1], tokens[2]
    close = [logprobs_close(a, ta, b, tb) for a, ta, b, tb in zip(ones, tops[1], twos, tops[2])]
    hf = report.get("hf_generate_batch", {}).get("output_tokens_per_s")
    return {
        "correctness": {
            "requests": len(ones), "new_tokens": sizes.check_tokens,
            "match_fraction": match_fraction(ones, twos),
            "mean_common_prefix": statistics.mean(map(common_prefix, ones, twos)),
            "logprobs_close_fraction": sum(close) / len(close),
            "top_logprobs": sizes.check_logprobs,
        },
        "tp2_over_tp1": {
            "ms_per_token": two["latency"]["ms_per_token"] / one["latency"]["ms_per_token"],
            "output_tokens_per_s": two["throughput"]["output_tokens_per_s"]
            / one["throughput"]["output_tokens_per_s"],
        },
        "over_hf_generate_batch": None if not hf else {
            f"tp{tp}": report["runs"][f"tp{tp}"]["throughput"]["output_tokens_per_s"] / hf
            for tp in (1, 2)},
    }


def tp_lines(t: dict[str, Any]) -> list[str]:
    """The part's block of the table."""
    m = t["shape"]
    lines = [f"  {m['layers']} layers x hidden {m['hidden']}, {t['dtype']}",
             f"  {'TP':<4}{'graphs':<8}{'ms/token':>10}{'out tok/s':>11}"]
    for run in t["runs"].values():
        lines.append(f"  {run['tensor_parallel_size']:<4}{'on' if run['cuda_graphs'] else 'off':<8}"
                     f"{run['latency']['ms_per_token']:>10.3f}"
                     f"{run['throughput']['output_tokens_per_s']:>11.1f}")
    if "tp2_over_tp1" in t:
        r, c = t["tp2_over_tp1"], t["correctness"]
        lines += [f"  TP=2 / TP=1: ms/token {r['ms_per_token']:.2f}x, out tok/s "
                  f"{r['output_tokens_per_s']:.2f}x",
                  f"  greedy: {c['match_fraction']:.2f} of {c['requests']} requests identical, "
                  f"mean common prefix {c['mean_common_prefix']:.1f} of {c['new_tokens']} tokens, "
                  f"{c['logprobs_close_fraction']:.2f} close by vLLM's top-{c['top_logprobs']} "
                  "logprobs rule"]
    if t.get("over_hf_generate_batch"):
        h = t["over_hf_generate_batch"]
        lines.append(f"  out tok/s over HF generate_batch: TP=1 {h['tp1']:.2f}x, "
                     f"TP=2 {h['tp2']:.2f}x")
    return lines
