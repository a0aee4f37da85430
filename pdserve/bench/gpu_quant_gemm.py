"""Quantized GEMMs at batch and prefill sizes: FP8 and W4A16 against bf16 F.linear on the
Llama-3.2-1B projection shapes, M = 8 .. 16384 tokens (the sizes of W1's decode steps and
prefill chunks; the GEMVs of 1-4 tokens are gpu_w4a16.py's and gpu_fp8.py's).

    python -m pdserve.bench.gpu_quant_gemm --out DIR          # on a GPU (gpu_kit_env.sh)
    python -m pdserve.bench.gpu_quant_gemm --small --out DIR  # the same code on the CPU

Per (shape, M), device ms per call replayed in a CUDA graph (median) and TFLOP/s:

    bf16             F.linear on the de-quantized weights
    fp8              the FP8 layer (Triton per-token quantization + torch._scaled_mm rowwise)
    fp8_mm           torch._scaled_mm alone (x already quantized)
    fp8_mm_fast      the same with use_fast_accum (no periodic promotion of the fp8 sums)
    fp8_mm_swap      the transposed product y^T = W x^T (the weight's rows as the long side of
                     the kernel's tiles), fast accumulation, then y made contiguous
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
import json
from collections.abc import Callable
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


def _variants(x: torch.Tensor, w4: Any, fp8: Any, dense: torch.Tensor, group: int, cuda: bool
              ) -> dict[str, Callable[[], torch.Tensor]]:
    m = x.shape[0]
    from kernels.fp8 import scaled_mm
    from kernels.fp8_quant import quantize_rows
    from kernels.fp8_w8a16 import w8a16_linear
    from kernels.w4a16 import GemmTile, w4a16_linear
    from kernels.w4a16_dequant import dequantize, w4a16_dequant_linear

    args = (w4.qweight, w4.scales, w4.zeros, group)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "bf16": lambda: F.linear(x, dense), "fp8": lambda: fp8(x), "w4a16_auto": lambda: w4(x),
        "fp8_w8a16": lambda: w8a16_linear(x, fp8.qweight, fp8.weight_scale),
        "w4a16_dequant": lambda: w4a16_dequant_linear(x, *args),
        "dequant": lambda: dequantize(*args, x.dtype)}
    if cuda and fp8.use_scaled_mm:
        xq, x_scale = quantize_rows(x)
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


def shape_rows(name: str, n: int, k: int, device: torch.device, group: int,
               tokens: tuple[int, ...]) -> list[dict[str, Any]]:
    w4, fp8, exact, fp8_exact = _layers(n, k, device, group)
    dense = exact.to(x_dtype := torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device=device, dtype=x_dtype)
        expected = {"w4a16": x.float() @ exact.t(), "fp8": x.float() @ fp8_exact.t()}
        row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "ms": {}, "tflops": {},
                               "rel_err": {}}
        for label, call in _variants(x, w4, fp8, dense, group, device.type == "cuda").items():
            try:
                out = call()
            except Exception as exc:  # a variant this build cannot run: named, not fatal
                row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            if label != "dequant":
                ref = expected["fp8" if label.startswith("fp8") else "w4a16"]
                row["rel_err"][label] = ((out.float() - ref).norm() / ref.norm()).item()
            ms = row["ms"][label] = device_ms(call, device)
            row["tflops"][label] = 2 * m * n * k / (ms * 1e-3) / 1e12
        gemms = {key: v for key, v in row["ms"].items() if key.startswith("w4a16_")}
        row["w4a16_best"] = min(gemms, key=gemms.get)
        rows.append(row)
        ms = row["ms"]
        print(f"{name} M={m}: bf16 {ms['bf16']:.4f} ms ({row['tflops']['bf16']:.0f} TFLOP/s), "
              f"fp8 {ms['fp8']:.4f} ({ms['bf16'] / ms['fp8']:.2f}x), w4a16 auto "
              f"{ms['w4a16_auto']:.4f} ({ms['bf16'] / ms['w4a16_auto']:.2f}x), best "
              f"{row['w4a16_best']} {ms[row['w4a16_best']]:.4f} "
              f"({ms['bf16'] / ms[row['w4a16_best']]:.2f}x), dequant alone "
              f"{ms['dequant']:.4f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="tiny shapes (the CPU)")
    parser.add_argument("--tokens", default=None, help="comma-separated M values")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
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
