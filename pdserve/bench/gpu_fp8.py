"""FP8 against bf16 on the random Llama-3.2-1B shape: batch-1 decode, W1 throughput, GEMMs.

    PYTHONPATH=. python -m pdserve.bench.gpu_fp8 --out DIR [--small]

The model of `pdserve bench gpu` (gpu_model.py: bf16 weights on disk) loads twice, one engine
after the other in the same process: `LLM(model)` (bf16) and `LLM(model, quantization="fp8")`
(quantized on load: per-output-channel fp8 weights, per-token fp8 activations). For each:

  batch1   decode ms/token, (time of 1 + N tokens - time of 1 token) / N, median over fresh
           prompts (gpu_generation.measure_latency), against its own weights-read floor: the
           bytes one decode step reads (fp8 projections + fp32 scales + bf16 embedding and norms
           for FP8; all bf16 otherwise) / the measured copy bandwidth
  w1       the throughput workload (256 requests, prompts of 128-512 random tokens, 128 greedy
           output tokens each) in one `generate`: output tokens/s; the greedy tokens' agreement

Then per GEMM of the model (qkv, o, gate_up, down) at M = 1, 64, 256 tokens, GPU time in a
CUDA graph (as decode steps run) and host time to issue one call (what eager steps pay): bf16
F.linear, the FP8 layer (its GEMV at M <= 4, else Triton per-token quantization +
torch._scaled_mm), the parts (quantization alone, Triton and eager; _scaled_mm alone), the GEMV
in a few tile shapes, and the W8A16 Triton GEMM (the fallback). Targets (the issue): FP8 <=
0.8 ms/token at batch 1, W1 >= 1.2x bf16. JSON goes to DIR/bench_gpu_fp8.json. `--small` runs
tiny shapes on the CPU (checks the code).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.bench.gpu_generation import _run_pdserve, measure_latency
from pdserve.bench.gpu_kernels import SMALL_KERNELS, KernelSizes, measure_ceilings, time_ms
from pdserve.bench.gpu_model import (
    BF16_BYTES,
    SMALL_MODEL,
    ModelShape,
    ModelSizes,
    RandomModel,
    free_device_memory,
    log,
)
from pdserve.bench.report import bench_main, config_of, write_report

GEMM_TOKENS = (1, 64, 256)
W8A16_TILES = ((16, 32, 128), (64, 64, 64))  # (BM, BN, BK)
GEMV_TILES = ((4, 1024), (8, 512), (16, 256), (4, 512))  # (BN, BK); None: the launcher's pick


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of the JSON report")
    parser.add_argument("--small", action="store_true", help="tiny shapes (checks the code)")
    parser.add_argument("--seed", type=int, default=0)


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(out, in) features of each fused projection pdserve runs."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"qkv": (q + 2 * kv, shape.hidden), "o": (shape.hidden, q),
            "gate_up": (2 * shape.intermediate, shape.hidden),
            "down": (shape.hidden, shape.intermediate)}


def weight_bytes(shape: ModelShape, fp8: bool) -> int:
    """Bytes of weights one decode step reads: every parameter once (the tied embedding is the
    lm_head); FP8 projections take 1 byte a weight plus one fp32 scale per output channel."""
    if not fp8:
        return shape.params * BF16_BYTES
    projections = shape.layers * shape.layer_weights
    channels = shape.layers * sum(out for out, _ in projection_shapes(shape).values())
    return (shape.params - projections) * BF16_BYTES + projections + 4 * channels


# ---- GEMMs ---------------------------------------------------------------------------------------
def graph_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Device ms of one call replayed in a CUDA graph (as decode steps run: no launch gaps)."""
    if device.type != "cuda":
        return time_ms(fn, device)
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def host_us(fn: Callable[[], object], device: torch.device) -> float:
    """Host microseconds to issue one call (eager steps pay it: prefill chunks, big batches)."""
    import time

    calls = 200 if device.type == "cuda" else 2
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return host


def layer_profile(shape: ModelShape, device: torch.device) -> str:
    """torch.profiler's table of 50 eager calls of the FP8 layer (gate_up, M = 128)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.quant.fp8 import Fp8Linear, quantize_weight

    n, k = projection_shapes(shape)["gate_up"]
    layer = Fp8Linear(k, n, bias=False).to(device=device, dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, slice(None),
                               quantize_weight(torch.randn(n, k, device=device)), "gate_up")
    x = torch.randn(128, k, device=device, dtype=torch.bfloat16)
    layer(x)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(50):
            layer(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=14)


def gemm_timings(shape: ModelShape, device: torch.device, tokens: tuple[int, ...]) -> list[dict]:
    """Per projection and M: ms of bf16 F.linear and of each FP8 variant (see the docstring)."""
    from engine.quant.fp8 import Fp8Linear, quantize_weight
    from kernels.fp8 import quantize_rows_ref, scaled_mm, scaled_mm_supported
    from kernels.fp8_gemv import GEMV_MAX_TOKENS, fp8_gemv
    from kernels.fp8_quant import quantize_rows
    from kernels.fp8_w8a16 import w8a16_linear

    dtype = torch.bfloat16
    rows = []
    for name, (n, k) in projection_shapes(shape).items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        fp8 = quantize_weight(w)
        layer = Fp8Linear(k, n, bias=False).to(device=device, dtype=dtype)
        layer.weight.weight_loader(layer.weight, slice(None), fp8, name)
        scale_row = fp8.scale.view(1, -1)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            variants: dict[str, Callable[[], object]] = {
                "bf16_linear": lambda x=x, w=w: F.linear(x, w),
                "fp8_layer": lambda x=x, layer=layer: layer(x),
                "quant_triton": lambda x=x: quantize_rows(x),
                "quant_eager": lambda x=x: quantize_rows_ref(x),
            }
            if scaled_mm_supported(device, k, n):
                xq, xs = quantize_rows(x)
                variants["scaled_mm_only"] = lambda xq=xq, xs=xs, fp8=fp8, sr=scale_row: \
                    scaled_mm(xq, xs, fp8.qweight, sr)
                variants["eager_quant_scaled_mm"] = lambda x=x, fp8=fp8, sr=scale_row: \
                    scaled_mm(*quantize_rows_ref(x), fp8.qweight, sr)
            if m <= GEMV_MAX_TOKENS:
                for tile in (None, *GEMV_TILES) if device.type == "cuda" else (None,):
                    variants[f"gemv_{'x'.join(map(str, tile or ('auto',)))}"] = \
                        lambda x=x, fp8=fp8, tile=tile: fp8_gemv(x, fp8.qweight, fp8.scale, tile)
            for tile in W8A16_TILES if device.type == "cuda" else W8A16_TILES[-1:]:
                variants[f"w8a16_{'x'.join(map(str, tile))}"] = \
                    lambda x=x, fp8=fp8, tile=tile: w8a16_linear(x, fp8.qweight, fp8.scale, tile)
            row: dict[str, Any] = {"gemm": name, "n": n, "k": k, "m": m, "fp8_path": (
                "gemv" if m <= GEMV_MAX_TOKENS else
                "scaled_mm" if layer.use_scaled_mm else "w8a16")}
            for label, fn in variants.items():
                try:
                    row[f"{label}_ms"] = graph_ms(fn, device)
                    row[f"{label}_host_us"] = host_us(fn, device)
                except Exception as exc:  # a variant this device cannot run
                    row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if "fp8_layer_ms" in row:
                row["bf16_over_fp8_layer"] = row["bf16_linear_ms"] / row["fp8_layer_ms"]
            rows.append(row)
            log(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                            for k, v in row.items()}))
    return rows


# ---- engines -------------------------------------------------------------------------------------
def run_engine(models: RandomModel, label: str, ceilings: dict, seed: int) -> dict[str, Any]:
    """W1 throughput, then batch-1 latency, of one engine (closed afterwards). `label`: bf16
    or fp8."""
    fp8 = label != "bf16"
    log(f"{label}: loading")
    models.llm_kwargs = {**models.llm_kwargs, "quantization": "fp8" if fp8 else None}
    result: dict[str, Any] = {}
    try:
        workload, result["w1"] = _run_pdserve(models, seed, use_tqdm=False)[0]
        log(f"{label}: W1 {result['w1'].get('output_tokens_per_s')}")
        result["tokens"] = _tokens(models, workload)
        result["step_profile"] = step_profile(models, workload)
        batch1 = measure_latency(models, None, seed)
        floor = weight_bytes(models.sizes.shape, fp8) / ceilings["copy_bytes_per_s"] * 1e3
        batch1.update(weights_bytes=weight_bytes(models.sizes.shape, fp8),
                      weights_floor_ms=floor, over_floor=batch1["ms_per_token"] / floor)
        log(f"{label}: batch-1 {batch1['ms_per_token']:.3f} ms/token (floor {floor:.3f})")
        graphs = models.llm().llm_engine.runner.graphs
        return {**result, "batch1": batch1,
                "cuda_graph_replays": None if graphs is None else graphs.replays}
    except Exception as exc:
        traceback.print_exc()
        return {**result, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    finally:
        models.close_llm()


def step_profile(models: RandomModel, workload: Any) -> str:
    """torch.profiler's table (by host time) of 16 of the workload's requests, 8 tokens each:
    where an eager step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p[::-1]} for p in workload.prompts[:16]]  # no cache hits
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                           else [])
    with profile(activities=activities) as prof:
        models.llm().generate(prompts, params, use_tqdm=False)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    log(table)
    return table


def _tokens(models: RandomModel, workload: Any) -> list[list[int]]:
    """Greedy tokens of the first 16 requests (for the agreement of the two engines)."""
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = models.llm().generate([{"prompt_token_ids": p} for p in workload.prompts[:16]],
                                 params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same_prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
                   for p, q in zip(a, b)]
    return {"identical_requests": sum(p == q for p, q in zip(a, b)) / len(a),
            "mean_common_prefix_tokens": sum(same_prefix) / len(same_prefix)}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    bf16, fp8 = report["systems"].get("bf16", {}), report["systems"].get("fp8", {})
    if any(part not in system for system in (bf16, fp8) for part in ("w1", "batch1")):
        return {}
    return {
        "batch1_ms_per_token": {"bf16": bf16["batch1"]["ms_per_token"],
                                "fp8": fp8["batch1"]["ms_per_token"]},
        "batch1_floor_ms": {"bf16": bf16["batch1"]["weights_floor_ms"],
                            "fp8": fp8["batch1"]["weights_floor_ms"]},
        "batch1_bf16_over_fp8": bf16["batch1"]["ms_per_token"] / fp8["batch1"]["ms_per_token"],
        "w1_tokens_per_s": {"bf16": bf16["w1"]["output_tokens_per_s"],
                            "fp8": fp8["w1"]["output_tokens_per_s"]},
        "w1_fp8_over_bf16": fp8["w1"]["output_tokens_per_s"] / bf16["w1"]["output_tokens_per_s"],
        "targets": {"fp8_batch1_ms": 0.8, "w1_fp8_over_bf16": 1.2},
        "greedy_agreement": _agreement(bf16["tokens"], fp8["tokens"]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = SMALL_MODEL if args.small else ModelSizes()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    kwargs: dict[str, Any] = {"max_num_seqs": sizes.max_num_seqs,
                              "kv_cache_memory": sizes.kv_cache_memory}
    if device.type == "cpu":
        kwargs.update(dtype="bfloat16", device="cpu")
    report: dict[str, Any] = {"config": config_of(args), "device": str(device), "systems": {}}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    report["ceilings"] = ceilings = measure_ceilings(
        device, torch.bfloat16, SMALL_KERNELS if args.small else KernelSizes())
    report["gemms"] = gemm_timings(sizes.shape, device, GEMM_TOKENS)
    report["layer_profile"] = layer_profile(sizes.shape, device)
    log(report["layer_profile"])
    write_report(report, str(out / "bench_gpu_fp8.json"))
    models = RandomModel(sizes, device, args.seed, None, kwargs)
    try:
        for label in ("bf16", "fp8"):
            report["systems"][label] = run_engine(models, label, ceilings, args.seed)
            write_report(report, str(out / "bench_gpu_fp8.json"))
    finally:
        models.remove()
        free_device_memory()
    report["summary"] = summarize(report)
    print(json.dumps(report["summary"], indent=2))
    write_report(report, str(out / "bench_gpu_fp8.json"))
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_fp8", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
