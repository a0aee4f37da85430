"""`pdserve bench gpu`, parts 3 and 4: offline throughput of the random Llama-3.2-1B shape
(gpu_model.py) in pdserve against HF transformers and the roofline, and its batch-1 latency.

Throughput runs one workload (`make_workload` of the throughput benchmark: seeded random token
ids, every request greedy to its full length) through pdserve `LLM.generate`, then HF `generate`
in left-padded batches and HF `generate_batch` (its continuous batching), each HF system on the
first requests only (it is slow), each reported as output tokens per second of what it ran.
pdserve runs `runs` times (default 3), each run on fresh prompts of the same shape (no prefix
cache hits), each reported with its own roofline ratio: the spread between runs is wide on the
lent GPUs; the first run is the one compared with HF.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.sampler import SampledTokens
from pdserve.bench.gpu_model import (
    BF16_BYTES,
    ModelSizes,
    RandomModel,
    device_memory,
    free_device_memory,
    log,
    roofline,
)
from pdserve.bench.throughput import (
    Measurement,
    Workload,
    _timed,
    bench_hf_padded,
    bench_pdserve,
    make_workload,
    summarize,
)


def _greedy(max_tokens: int) -> Any:
    from pdserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- part 3: throughput --------------------------------------------------------------------------
def measure_throughput(
    models: RandomModel, ceilings: dict | None, seed: int, use_tqdm: bool,
    checkpoint: Callable[[dict[str, Any]], None], runs: int = 3,
) -> dict[str, Any]:
    """pdserve (`runs` times), HF padded `generate` and HF `generate_batch` on one workload, and
    the roofline. Calls `checkpoint(report so far)` after each system: HF may not finish in the
    time left."""
    measured = _run_pdserve(models, seed, use_tqdm, runs)
    models.close_llm()
    workload, ours = measured[0]
    ours = {**ours, "runs": [_run_summary(w, r, models, ceilings) for w, r in measured]}
    report: dict[str, Any] = {
        "workload": {"requests": len(workload.prompts), "input_tokens": workload.input_tokens,
                     "output_tokens": workload.output_tokens},
        "systems": {"pdserve": ours}, "ratios": {},
        "device_memory_before_hf": device_memory(),  # what pdserve left behind
    }
    if ceilings is not None:
        roof = roofline(models.sizes.shape, workload, BF16_BYTES, ceilings)
        roof["pdserve_fraction"] = ours["output_tokens_per_s"] / roof["output_tokens_per_s"]
        report["roofline"] = roof
    checkpoint(report)
    try:
        for name, result in measure_hf(models.folder, workload, models.sizes, models.device):
            report["systems"][name] = result
            if "error" not in result:
                report["ratios"][f"pdserve_over_{name}"] = ours["output_tokens_per_s"] \
                    / result["output_tokens_per_s"]
            checkpoint(report)
    except Exception as exc:  # HF did not load: keep pdserve's figures
        traceback.print_exc()
        report["hf_error"] = f"{type(exc).__name__}: {exc}"
    return report


def _run_summary(workload: Workload, result: dict[str, Any], models: RandomModel,
                 ceilings: dict | None) -> dict[str, Any]:
    """One pdserve run: its wall time, output tokens/s and their ratio to its roofline."""
    out = {"wall_s": result["wall_s"], "output_tokens_per_s": result["output_tokens_per_s"]}
    if ceilings is not None:
        roof = roofline(models.sizes.shape, workload, BF16_BYTES, ceilings)
        out["roofline_fraction"] = result["output_tokens_per_s"] / roof["output_tokens_per_s"]
    return out


def _run_pdserve(models: RandomModel, seed: int, use_tqdm: bool, runs: int = 1
                 ) -> list[tuple[Workload, dict]]:
    """The workload through `LLM.generate`, after a warm-up on as many other prompts (no prefix
    cache hits) as run at once; then `runs - 1` more times on fresh prompts of the same shape."""
    llm, sizes = models.llm(), models.sizes
    lens = (sizes.output_len, sizes.output_len)
    workload = make_workload(llm.get_tokenizer(), sizes.num_requests, sizes.input_len_range,
                             lens, seed)
    warm = make_workload(llm.get_tokenizer(), min(sizes.max_num_seqs, sizes.num_requests),
                         sizes.input_len_range, (4, 4), seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in warm.prompts], _greedy(4), use_tqdm=False)
    measured = []
    for run in range(runs):
        if run:
            workload = make_workload(llm.get_tokenizer(), sizes.num_requests,
                                     sizes.input_len_range, lens, seed + 100 + run)
        log(f"pdserve: {len(workload.prompts)} requests, run {run + 1} of {runs}")
        measurement = bench_pdserve(llm, workload, use_tqdm)
        measured.append((workload, {"requests": len(workload.prompts),
                                    **summarize(measurement, workload)}))
    return measured


def measure_hf(
    folder: str, workload: Workload, sizes: ModelSizes, device: torch.device
) -> Iterator[tuple[str, dict[str, Any]]]:
    """HF padded batches, then `generate_batch`, each on the first requests of the workload,
    yielded as they finish; a system that fails is reported as its error."""
    from engine.model_loader import load_hf_model

    model = load_hf_model(folder, torch.bfloat16).to(device)
    padded, cb = subset(workload, sizes.hf_padded_requests), subset(workload, sizes.hf_cb_requests)
    log(f"hf_padded: {len(padded.prompts)} requests in batches of {sizes.hf_batch_size}")
    yield "hf_padded", _system(padded, bench_hf_padded_batches, model, sizes.hf_batch_size)
    log(f"hf_generate_batch: {len(cb.prompts)} requests")
    yield "hf_generate_batch", _system(cb, bench_hf_generate_batch, model, sizes.hf_cb_num_blocks)
    del model
    free_device_memory()


def _system(workload: Workload, bench: Callable[..., tuple[Measurement, dict]], model: Any,
            option: int | None) -> dict[str, Any]:
    """`bench(model, workload, option)` summarized, or its error."""
    try:
        measurement, extra = bench(model, workload, option)
    except Exception as exc:  # HF's API moves between versions: keep the other figures
        traceback.print_exc()
        return {"requests": len(workload.prompts), "error": f"{type(exc).__name__}: {exc}"}
    return {"requests": len(workload.prompts), **summarize(measurement, workload), **extra}


def bench_hf_padded_batches(
    model: Any, workload: Workload, batch_size: int
) -> tuple[Measurement, dict[str, Any]]:
    """`bench_hf_padded` on consecutive batches; their times add up."""
    pad = model.config.eos_token_id
    batches = [bench_hf_padded(model, subset(workload, batch_size, i), pad)
               for i in range(0, len(workload.prompts), batch_size)]
    merged = Measurement(sum(b.seconds for b in batches), sum(b.cpu_seconds for b in batches),
                         [t for b in batches for t in b.tokens],
                         sum(b.generated_tokens for b in batches))
    return merged, {"batch_size": batch_size}


def subset(workload: Workload, count: int, start: int = 0) -> Workload:
    end = start + count
    return Workload(workload.prompts[start:end], workload.output_lens[start:end])


def bench_hf_generate_batch(
    model: Any, workload: Workload, num_blocks: int | None
) -> tuple[Measurement, dict[str, float]]:
    """transformers' continuous batching: greedy, eos disabled. The model stays on SDPA;
    `generate_batch` switches it to its paged form itself (5.17: "paged|sdpa", or flash attention
    where installed; 5.23 runs "sdpa" as it is) and back when done.

    Its wall time runs from the first request's creation to the last one's end (its own stamps):
    before that the call sizes its cache and captures CUDA graphs (`call_s` has all of it;
    `cpu_s` too)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    cb = None if num_blocks is None else ContinuousBatchingConfig(num_blocks=num_blocks)
    outputs, call_s, cpu_s = _timed(
        lambda: model.generate_batch(workload.prompts, generation_config=config,
                                     continuous_batching_config=cb), model.device)
    done = list(outputs.values())
    failed = [o.error for o in done if o.error is not None]
    if len(done) != len(workload.prompts) or failed:
        raise RuntimeError(f"generate_batch finished {len(done) - len(failed)} of "
                           f"{len(workload.prompts)} requests: {failed[:3]}")
    seconds = max(o.lifespan[1] for o in done) - min(o.created_time for o in done)
    tokens = [list(o.generated_tokens) for o in done]
    return Measurement(seconds, cpu_s, tokens, sum(map(len, tokens))), {"call_s": call_s}


# ---- part 4: latency -----------------------------------------------------------------------------
@contextmanager
def _token_waits() -> Iterator[list[float]]:
    """Seconds of each wait for a step's sampled tokens while the block runs (a diagnostic:
    `SampledTokens.to_host` timed)."""
    waits: list[float] = []
    real = SampledTokens.to_host

    def timed(self: SampledTokens) -> Any:
        start = time.perf_counter()
        try:
            return real(self)
        finally:
            waits.append(time.perf_counter() - start)

    SampledTokens.to_host = timed  # type: ignore[method-assign]
    try:
        yield waits
    finally:
        SampledTokens.to_host = real  # type: ignore[method-assign]


def measure_latency(models: RandomModel, ceilings: dict | None, seed: int) -> dict[str, Any]:
    """Batch-1 decode: (time of 1 + N tokens - time of 1 token) / N, median over fresh prompts
    (no prefix-cache hits), and the same from the engine's first-token and finish stamps. Of
    the first figure, `wait_ms_per_token`: as much time spent by the same rule waiting for the
    GPU's tokens (`SampledTokens.to_host`); ~0 when the host's own work is the step's bound."""
    sizes, llm = models.sizes, models.llm()
    n, length = sizes.latency_decode_tokens, sizes.latency_prompt_len
    prompts = make_workload(llm.get_tokenizer(), 2 * sizes.latency_repeats + 1, (length, length),
                            (1, 1), seed + 2).prompts

    def run(prompt: list[int], max_tokens: int) -> tuple[Any, float, float]:
        waits.clear()
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], _greedy(max_tokens), use_tqdm=False)[0]
        got = len(out.outputs[0].token_ids)
        if got != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, got {got}")
        return out, time.perf_counter() - start, sum(waits)

    with _token_waits() as waits:
        run(prompts[-1], n + 1)  # warm-up
        short = [run(prompts[2 * i], 1) for i in range(sizes.latency_repeats)]
        longs = [run(prompts[2 * i + 1], n + 1) for i in range(sizes.latency_repeats)]
    stamps = [(o.metrics.finished_time - o.metrics.first_token_time) / n for o, _, _ in longs
              if o.metrics is not None and o.metrics.first_token_time is not None]

    def per_token(i: int) -> float:  # ms: median of the long runs' less the short runs'
        return (statistics.median(r[i] for r in longs)
                - statistics.median(r[i] for r in short)) / n * 1e3

    report: dict[str, Any] = {
        "prompt_tokens": length, "decode_tokens": n,
        "ms_per_token": per_token(1),
        "ms_per_token_engine_stamps": statistics.median(stamps) * 1e3 if stamps else None,
        "wait_ms_per_token": per_token(2),
        "ttft_ms": statistics.median(r[1] for r in short) * 1e3,
    }
    if ceilings is not None:
        floor = sizes.shape.params * BF16_BYTES / ceilings["copy_bytes_per_s"] * 1e3
        report.update(weights_floor_ms=floor, over_floor=report["ms_per_token"] / floor)
    return report
