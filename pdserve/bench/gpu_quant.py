"""Quantized weights end to end on the random Llama-3.2-1B shape: bf16, FP8 and W4A16 engines.

    PYTHONPATH=. python -m pdserve.bench.gpu_quant --out DIR [--systems bf16,fp8,w4a16] [--small]

The model of `pdserve bench gpu` (gpu_model.py: bf16 weights on disk) is served several ways,
one engine after the other in this process: as it is (bf16), `quantization="fp8"` (quantized on
load), the same with `kv_cache_dtype="fp8"` (fp8_kv8: what `--quantization fp8 --kv-cache-dtype
fp8` serves; its activations quantized by the norm or SwiGLU before each projection,
engine/models/fp8_inputs.py) or with each projection quantizing its own activations
(fp8_unfused) or with its rows' products by the Triton FP8
GEMM (fp8_triton: kernels/fp8_gemm.py, not torch._scaled_mm) and a W4A16 checkpoint written
from it by engine/quant/w4a16_quantize.py (AutoAWQ's `gemm` layout, group 128 with zeros, round
to nearest; the format detected from config.json);
w4a16_fused serves that checkpoint with the norms and SwiGLU in the GEMV's prologue instead of
as kernels of their own (`W4A16Linear.prologues` on), w4a16_fp32 with the GEMV's fp32 loop
instead of its fp16 code pairs (`W4A16Linear.pairs` off), w4a16_st3 with three steps of the
GEMV's loads in flight (`W4A16Linear.stages`), w4a16_tma with three of the codes' tiles in
flight by TMA descriptor (`W4A16Linear.tma`). Any system with `_hostargmax` appended serves
without the decode graphs' argmax graphs (engine/cuda_graphs.py: a greedy step's logits and
argmax launched from the host, as before 2026-12-04). For each:

  batch1   decode ms/token, (time of 1 + N tokens - time of 1 token) / N, median over fresh
           prompts (gpu_generation.measure_latency), against its own weights-read floor: the
           bytes one decode step reads / the copy bandwidth measured in the same run (bf16: every
           parameter; fp8: 1 byte a projection weight + an fp32 scale per output channel;
           w4a16: half a byte a projection weight + an fp16 scale and a 4-bit zero per group of
           128; the tied embedding/lm_head and the norms bf16 in all three)
  w1       the throughput workload (256 requests, prompts of 128-512, 128 greedy tokens each)
           in one `generate`, `--w1-runs` times on fresh prompts: output tokens/s of each
           run (`runs`) and their median (`output_tokens_per_s`, what the ratios compare)
  tokens   greedy tokens of 16 requests, their agreement with bf16's (quantization changes the
           weights, so late divergence is expected: reported, not asserted)

Targets (the quantization issue): bf16 <= 1.2 ms/token, FP8 <= 0.8 and W1 >= 1.2x bf16, W4A16
<= 0.6 ms/token. JSON goes to DIR/bench_gpu_quant.json. `--small` runs the tiny shape on the CPU
(checks the code).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_fp8 import _agreement, _tokens, projection_shapes
from pdserve.bench.gpu_generation import _run_pdserve, measure_latency
from pdserve.bench.gpu_kernels import SMALL_KERNELS, KernelSizes, measure_ceilings
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

SYSTEMS = ("bf16", "fp8", "fp8_kv8", "fp8_unfused", "fp8_triton", "w4a16", "w4a16_fused",
           "w4a16_fp32", "w4a16_st3", "w4a16_tma")
HOST_ARGMAX = "_hostargmax"  # a system's suffix: its greedy steps without argmax graphs
W4A16_GROUP = 128
TARGET_MS = {"bf16": 1.2, "fp8": 0.8, "fp8_kv8": 0.8, "fp8_unfused": 0.8, "fp8_triton": 0.8,
             "w4a16": 0.6,
             "w4a16_fused": 0.6,
             "w4a16_fp32": 0.6, "w4a16_st3": 0.6, "w4a16_tma": 0.6}
TARGET_MS.update({name + HOST_ARGMAX: ms for name, ms in TARGET_MS.items()})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of the JSON report")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="of " + ", ".join(SYSTEMS))
    parser.add_argument("--w1-runs", type=int, default=3, help="W1 runs per system")
    parser.add_argument("--no-w1", action="store_true", help="batch-1 latency only")
    parser.add_argument("--small", action="store_true", help="tiny shapes (checks the code)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=None,
                        help="keep the random bf16 model here (reused when it holds one)")


def weight_bytes(shape: ModelShape, system: str) -> int:
    """Bytes of weights one decode step reads (see the docstring)."""
    projections = shape.layers * shape.layer_weights
    rest = (shape.params - projections) * BF16_BYTES
    outs = shape.layers * sum(out for out, _ in projection_shapes(shape).values())
    if system == "fp8":
        return rest + projections + 4 * outs
    if system == "w4a16":
        groups = shape.layers * sum(out * max(inp // W4A16_GROUP, 1)
                                    for out, inp in projection_shapes(shape).values())
        return rest + projections // 2 + groups * 2 + groups // 2
    return shape.params * BF16_BYTES


def run_system(models: RandomModel, system: str, ceilings: dict, args: argparse.Namespace
               ) -> dict[str, Any]:
    """W1 throughput (unless --no-w1), greedy tokens, then batch-1 latency of one engine
    (closed afterwards)."""
    log(f"{system}: loading")
    result: dict[str, Any] = {}
    try:
        if not args.no_w1:
            runs = _run_pdserve(models, args.seed, use_tqdm=False, runs=args.w1_runs)
            workload = runs[0][0]
            rates = [r["output_tokens_per_s"] for _, r in runs]
            result["w1"] = {**runs[0][1], "runs": rates,
                            "output_tokens_per_s": statistics.median(rates)}
            log(f"{system}: W1 {result['w1'].get('output_tokens_per_s')}")
            result["tokens"] = _tokens(models, workload)
        batch1 = measure_latency(models, None, args.seed)
        model = models.llm().llm_engine.runner.model
        batch1["decode_gemv_plan"] = getattr(model, "decode_gemv_report", None)  # CUDA only
        weights = system.split("_")[0]  # bf16, fp8 or w4a16: what the step reads
        need = weight_bytes(models.sizes.shape, weights)
        floor = need / ceilings["copy_bytes_per_s"] * 1e3
        batch1.update(weights_bytes=need, weights_floor_ms=floor,
                      over_floor=batch1["ms_per_token"] / floor)
        log(f"{system}: batch-1 {batch1['ms_per_token']:.3f} ms/token (floor {floor:.3f}; "
            f"waiting for the GPU {batch1['wait_ms_per_token']:.3f}, TTFT "
            f"{batch1['ttft_ms']:.1f} ms)")
        return {**result, "batch1": batch1}
    except Exception as exc:
        traceback.print_exc()
        return {**result, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    finally:
        models.close_llm()


@contextmanager
def serving(system: str) -> Iterator[None]:
    """The settings `system` is served with, while the block runs: w4a16_fused turns
    `W4A16Linear.prologues` on (the norms and SwiGLU in the GEMV), w4a16_fp32 turns
    `W4A16Linear.pairs` off (the GEMV's fp32 loop), w4a16_st3 sets `W4A16Linear.stages` to 3,
    w4a16_tma turns `W4A16Linear.tma` on with three stages (the codes by TMA),
    fp8_unfused turns `Fp8Linear.fused_inputs` off (each projection quantizes its rows),
    fp8_triton turns `Fp8Linear.triton_gemm` on;
    the `_hostargmax` suffix sets `DecodeGraphs.argmax_max_batch` to 0."""
    from engine.cuda_graphs import DecodeGraphs
    from engine.quant.fp8 import Fp8Linear
    from engine.quant.w4a16_linear import W4A16Linear

    base = system.removesuffix(HOST_ARGMAX)
    settings = [(W4A16Linear, "prologues", base == "w4a16_fused"),
                (W4A16Linear, "pairs", base != "w4a16_fp32"),
                (W4A16Linear, "stages", 3 if base in ("w4a16_st3", "w4a16_tma") else 1),
                (W4A16Linear, "tma", base == "w4a16_tma"),
                (Fp8Linear, "fused_inputs", base != "fp8_unfused"),
                (Fp8Linear, "triton_gemm", base == "fp8_triton"),
                (DecodeGraphs, "argmax_max_batch",
                 0 if system.endswith(HOST_ARGMAX) else DecodeGraphs.argmax_max_batch)]
    before = [(owner, name, getattr(owner, name)) for owner, name, _ in settings]
    for owner, name, value in settings:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in before:
            setattr(owner, name, value)


def engine_for(system: str, base: RandomModel, kwargs: dict[str, Any]) -> RandomModel:
    """The engine source of `system`: the bf16 folder (fp8 quantizes it on load; fp8_kv8 also
    keeps its KV cache in fp8), or a W4A16 checkpoint written next to it."""
    system = system.removesuffix(HOST_ARGMAX)
    if system == "bf16":
        return base
    if system in ("fp8", "fp8_kv8", "fp8_unfused", "fp8_triton"):
        kv = {"kv_cache_dtype": "fp8"} if system == "fp8_kv8" else {}
        return RandomModel(base.sizes, base.device, base.seed, base.folder,
                           {**kwargs, "quantization": "fp8", **kv})
    from engine.quant.w4a16_quantize import write_checkpoint

    folder = Path(base.folder + "-awq")
    if not (folder / "config.json").is_file():
        log(f"writing the AWQ checkpoint {folder}")
        shutil.rmtree(folder, ignore_errors=True)
        group = W4A16_GROUP if not base.sizes.shape.hidden < W4A16_GROUP else 32
        write_checkpoint(base.folder, folder, "awq", group_size=group, symmetric=False)
    return RandomModel(base.sizes, base.device, base.seed, str(folder), kwargs)


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    systems = report["systems"]
    summary: dict[str, Any] = {"batch1_ms_per_token": {}, "batch1_floor_ms": {},
                               "targets_ms": TARGET_MS}
    for name, s in systems.items():
        if "batch1" in s:
            summary["batch1_ms_per_token"][name] = s["batch1"]["ms_per_token"]
            summary["batch1_floor_ms"][name] = s["batch1"]["weights_floor_ms"]
    base = systems.get("bf16", {})
    for name, s in systems.items():
        if name != "bf16" and "w1" in s and "w1" in base:
            summary[f"w1_{name}_over_bf16"] = (s["w1"]["output_tokens_per_s"]
                                               / base["w1"]["output_tokens_per_s"])
            summary[f"greedy_agreement_{name}"] = _agreement(base["tokens"], s["tokens"])
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    systems = [s for s in args.systems.split(",") if s]
    if unknown := sorted({s.removesuffix(HOST_ARGMAX) for s in systems} - set(SYSTEMS)):
        raise ValueError(f"--systems: unknown {unknown}; choose from {SYSTEMS}, each "
                         f"optionally with {HOST_ARGMAX} appended")
    sizes = SMALL_MODEL if args.small else ModelSizes()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kwargs: dict[str, Any] = {"max_num_seqs": sizes.max_num_seqs,
                              "kv_cache_memory": sizes.kv_cache_memory}
    if device.type == "cpu":
        kwargs.update(dtype="bfloat16", device="cpu")
    else:  # the engine settings of `pdserve bench gpu` (gpu.py _llm_kwargs)
        kwargs.update(dtype="bfloat16", max_num_batched_tokens=16384)
    report: dict[str, Any] = {"config": config_of(args), "device": str(device), "systems": {}}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    report["ceilings"] = ceilings = measure_ceilings(
        device, torch.bfloat16, SMALL_KERNELS if args.small else KernelSizes())
    path = str(Path(args.out) / "bench_gpu_quant.json")
    base = RandomModel(sizes, device, args.seed, args.model_dir, kwargs)
    try:
        for system in systems:
            models = engine_for(system, base, kwargs)
            with serving(system):
                report["systems"][system] = run_system(models, system, ceilings, args)
            write_report(report, path)
    finally:
        if args.model_dir is None:
            shutil.rmtree(base.folder + "-awq", ignore_errors=True)
        base.remove()
        free_device_memory()
    report["summary"] = summarize(report)
    print(json.dumps(report["summary"], indent=2))
    write_report(report, path)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_quant", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
