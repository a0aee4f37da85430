"""Quantized GEMMs at batch and prefill sizes: FP8 and W4A16 against bf16 F.linear on the
Llama-3.2-1B projection shapes, M = 8 .. 16384 tokens (the sizes of W1's decode steps and
prefill chunks; the GEMVs of 1-4 tokens are gpu_w4a16.py's and gpu_fp8.py's).

    python -m pdserve.bench.gpu_quant_gemm --out DIR          # on a GPU (gpu_kit_env.sh)
    python -m pdserve.bench.gpu_quant_gemm --small --out DIR  # the same code on the CPU
    python -m pdserve.bench.gpu_quant_gemm --tokens 64,128,256,512 --out DIR  # some M only

Per (shape, M), device ms per call replayed in a CUDA graph (median) and TFLOP/s:

    bf16             F.linear on the de-quantized weights
    fp8              the FP8 layer (Triton per-token quantization + torch._scaled_mm rowwise)
    fp8_mm           torch._scaled_mm alone (x already quantized)
    fp8_mm_fast      the same with use_fast_accum (no periodic promotion of the fp8 sums)
    fp8_mm_swap      the transposed product y^T = W x^T (the weight's rows as the long side of
                     the kernel's tiles), fast accumulation, then y made contiguous
    fp8_triton       kernels/fp8_gemm.py (fp8 x fp8 Triton GEMM, split K) at its default
                     launch for the shape (x already quantized)
    fp8_triton_best  the fastest of FP8_TILES x FP8_SPLITS launches of it at this (shape, M);
                     the row names it (fp8_triton_best: its config) and keeps every launch's ms
                     (fp8_triton_configs)
    fp8_w8a16        the W8A16 Triton GEMM (fp8 weights widened in registers, bf16 x)
    w4a16_auto       the W4A16 layer's own choice at this M
    w4a16_<tile>     the in-register de-quantizing Triton GEMM, one launch shape each
                     (BLOCK_M x BLOCK_N, warps, stages; no split-K)
    w4a16_dequant    W de-quantized to bf16 by a Triton kernel, then torch.mm
    dequant          the de-quantization alone

and each variant's error against the fp32 matmul of its own de-quantized weights. Writes
DIR/gpu_quant_gemm.json and prints one line per (shape, M).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.bench.gpu_w4a16 import SHAPES, copy_bandwidth, device_ms

SMALL_SHAPES = {"64x64": (64, 64), "64x128": (128, 64)}
TOKENS = (8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
SMALL_TOKENS = (16, 40)
# (BLOCK_M, BLOCK_N, warps, stages)
# (2026-11-29, H200: these two and six other shapes from 64 x 64 to 128 x 256 were all slower
# than de-quantizing + cuBLAS above 64 tokens; docs/results/gpu_quant_gemm_h200_2026-11-29.json)
TILES = ((64, 64, 4, 3), (128, 128, 8, 3))
GROUP = 128
# fp8_triton_best's launches: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) x K shares, each share
# at least one whole K step (the CPU: two tiny tiles, one or two shares)
FP8_TILES = ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 128, 128, 8, 3),
             (128, 128, 64, 4, 4), (128, 256, 64, 8, 3))
FP8_SPLITS = (1, 2, 4, 8)
SMALL_FP8_TILES = ((16, 32, 32, 4, 1), (32, 64, 32, 4, 1))
SMALL_FP8_SPLITS = (1, 2)


def _layers(n: int, k: int, device: torch.device, group: int
            ) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """(the W4A16 layer, the FP8 layer, each one's W [N, K] in fp32) from one random
    weight."""
    from engine.quant.fp8 import Fp8Linear
    from engine.quant.w4a16 import dequantize
    from engine.quant.w4a16_linear import W4A16Linear
    from engine.quant.w4a16_quantize import quantize

    dense = torch.randn(n, k) * 0.02  # the FP8 layer quantizes this one itself
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: keep qweight
    w4 = quantize(dense, group, symmetric=False)
    w4_layer = W4A16Linear(k, n, bias=False).to(device=device, dtype=dtype)
    w4_layer.weight.weight_loader(w4_layer.weight, slice(None), w4, "w")
    fp8_layer = Fp8Linear(k, n, bias=False).to(device=device, dtype=dtype)
    fp8_layer.weight.weight_loader(fp8_layer.weight, slice(None), dense.to(device), "w")
    fp8_exact = (fp8_layer.qweight.float() * fp8_layer.weight_scale[:, None]).to(device)
    return w4_layer, fp8_layer, dequantize(w4).to(device), fp8_exact


def _quantized(x: torch.Tensor, cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x per token in fp8 (xq [M, K], x_scale [M, 1]): the Triton kernel, the reference on the
    CPU."""
    from kernels.fp8 import quantize_rows_ref
    from kernels.fp8_quant import quantize_rows

    return quantize_rows(x) if cuda else quantize_rows_ref(x)


def _variants(x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor], w4: Any, fp8: Any,
              dense: torch.Tensor, group: int, cuda: bool
              ) -> dict[str, Callable[[], torch.Tensor]]:
    m = x.shape[0]
    from kernels.fp8 import scaled_mm
    from kernels.fp8_gemm import fp8_gemm
    from kernels.fp8_w8a16 import w8a16_linear
    from kernels.w4a16 import GemmTile, w4a16_linear
    from kernels.w4a16_dequant import dequantize, w4a16_dequant_linear

    args = (w4.qweight, w4.scales, w4.zeros, group)
    xq, x_scale = quantized
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "bf16": lambda: F.linear(x, dense), "fp8": lambda: fp8(x), "w4a16_auto": lambda: w4(x),
        "fp8_triton": lambda: fp8_gemm(xq, x_scale, fp8.qweight, fp8.weight_scale),
        "fp8_w8a16": lambda: w8a16_linear(x, fp8.qweight, fp8.weight_scale),
        "w4a16_dequant": lambda: w4a16_dequant_linear(x, *args),
        "dequant": lambda: dequantize(*args, x.dtype)}
    if cuda and fp8.use_scaled_mm:
        calls["fp8_mm"] = lambda: scaled_mm(xq, x_scale, fp8.qweight, fp8.scale_row)
        calls["fp8_mm_fast"] = lambda: torch._scaled_mm(
            xq, fp8.qweight.t(), scale_a=x_scale, scale_b=fp8.scale_row,
            out_dtype=torch.bfloat16, use_fast_accum=True)
        w_col, x_row = fp8.weight_scale.view(-1, 1), x_scale.view(1, -1)
        if m % 16 == 0:
            calls["fp8_mm_swap"] = lambda: torch._scaled_mm(
                fp8.qweight, xq.t(), scale_a=w_col, scale_b=x_row, out_dtype=torch.bfloat16,
                use_fast_accum=True).t().contiguous()
    for bm, bn, warps, stages in TILES if cuda else TILES[:1]:
        tile = GemmTile(bm, bn, warps, stages)
        calls[f"w4a16_{bm}x{bn}w{warps}s{stages}"] = \
            lambda t=tile: w4a16_linear(x, *args, t, split_k=1)
    return calls


def fp8_configs(k: int, cuda: bool) -> list[Any]:
    """fp8_triton_best's launches: FP8_TILES x FP8_SPLITS, a share at least one whole K step."""
    from kernels.fp8_gemm import Fp8GemmConfig

    tiles, splits = (FP8_TILES, FP8_SPLITS) if cuda else (SMALL_FP8_TILES, SMALL_FP8_SPLITS)
    return [Fp8GemmConfig(bm, bn, bk, split, warps, stages)
            for bm, bn, bk, warps, stages in tiles for split in splits
            if k // bk >= split]


def _measure(row: dict[str, Any], label: str, call: Callable[[], torch.Tensor],
             ref: torch.Tensor | None, device: torch.device) -> float | None:
    """Time `call` into row["ms"][label] (and its TFLOP/s, its error against `ref`); a variant
    this build cannot run is named in row["errors"], not fatal."""
    try:
        out = call()
        ms = device_ms(call, device)
    except Exception as exc:
        row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"[:300]
        return None
    if ref is not None:
        row["rel_err"][label] = ((out.float() - ref).norm() / ref.norm()).item()
    row["ms"][label] = ms
    row["tflops"][label] = 2 * row["m"] * row["n"] * row["k"] / (ms * 1e-3) / 1e12
    return ms


def fp8_triton_best(row: dict[str, Any], xq: tuple[torch.Tensor, torch.Tensor], fp8: Any,
                    ref: torch.Tensor, device: torch.device) -> None:
    """Each of `fp8_configs` timed (row["fp8_triton_configs"]: label -> ms), the fastest again
    as the variant fp8_triton_best, its launch in row["fp8_triton_best"]; the default launch in
    row["fp8_triton_config"]."""
    from kernels.fp8_gemm import default_config, fp8_gemm
    from kernels.w4a16 import sm_count

    m, n, k = row["m"], row["n"], row["k"]
    row["fp8_triton_config"] = asdict(default_config(m, n, k, sm_count(device)))
    timings: dict[str, float] = {}
    calls: dict[str, tuple[Any, Callable[[], torch.Tensor]]] = {}
    row["fp8_triton_configs"] = timings
    for config in fp8_configs(k, device.type == "cuda"):
        call = functools.partial(fp8_gemm, *xq, fp8.qweight, fp8.weight_scale, config=config)
        try:
            timings[config.label] = device_ms(call, device)
        except Exception as exc:  # e.g. more shared memory than the GPU has: named, not fatal
            row.setdefault("errors", {})[f"fp8_triton_{config.label}"] = \
                f"{type(exc).__name__}: {exc}"[:300]
            continue
        calls[config.label] = (config, call)
    if timings:
        best, call = calls[min(timings, key=timings.get)]
        _measure(row, "fp8_triton_best", call, ref, device)
        row["fp8_triton_best"] = {"label": best.label, **asdict(best)}


def _summary(name: str, row: dict[str, Any]) -> str:
    ms = row["ms"]

    def vs_bf16(label: str) -> str:
        return f"{ms[label]:.4f} ({ms['bf16'] / ms[label]:.2f}x)" if label in ms else "-"

    best = row.get("fp8_triton_best", {}).get("label", "-")
    return (f"{name} M={row['m']}: bf16 {ms['bf16']:.4f} ms ({row['tflops']['bf16']:.0f} "
            f"TFLOP/s), fp8 {vs_bf16('fp8')}, w4a16 auto {vs_bf16('w4a16_auto')}, best "
            f"{row['w4a16_best']} {vs_bf16(row['w4a16_best'])}, dequant alone "
            f"{ms['dequant']:.4f}\n    fp8_mm_fast {vs_bf16('fp8_mm_fast')}, fp8_triton "
            f"{vs_bf16('fp8_triton')}, fp8_triton_best {best} {vs_bf16('fp8_triton_best')}")


def shape_rows(name: str, n: int, k: int, device: torch.device, group: int,
               tokens: tuple[int, ...]) -> list[dict[str, Any]]:
    w4, fp8, exact, fp8_exact = _layers(n, k, device, group)
    dense = exact.to(x_dtype := torch.bfloat16 if device.type == "cuda" else torch.float32)
    cuda = device.type == "cuda"
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device=device, dtype=x_dtype)
        expected = {"w4a16": x.float() @ exact.t(), "fp8": x.float() @ fp8_exact.t()}
        row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "ms": {}, "tflops": {},
                               "rel_err": {}}
        xq = _quantized(x, cuda)
        for label, call in _variants(x, xq, w4, fp8, dense, group, cuda).items():
            ref = None if label == "dequant" else expected[
                "fp8" if label.startswith("fp8") else "w4a16"]
            _measure(row, label, call, ref, device)
        fp8_triton_best(row, xq, fp8, expected["fp8"], device)
        gemms = {key: v for key, v in row["ms"].items() if key.startswith("w4a16_")}
        row["w4a16_best"] = min(gemms, key=gemms.get)
        rows.append(row)
        print(_summary(name, row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="tiny shapes (the CPU)")
    parser.add_argument("--tokens", default=None, help="comma-separated M values")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if device.type == "cpu":  # the Triton kernels through its interpreter; set before import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shapes, group = (SMALL_SHAPES, 32) if args.small else (SHAPES, GROUP)
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
        SMALL_TOKENS if args.small else TOKENS)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "group_size": group, "copy_bandwidth_bytes_per_s": copy_bandwidth(device), "rows": []}
    for name, (n, k) in shapes.items():
        report["rows"] += shape_rows(name, n, k, device, group, tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_quant_gemm.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
