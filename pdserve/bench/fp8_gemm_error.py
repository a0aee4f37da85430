"""kernels/fp8_gemm.py's error against kernels/fp8.py `scaled_mm_ref`, launch by launch, on a GPU.

    python -m pdserve.bench.fp8_gemm_error [--output-json bench_results/fp8_gemm_error.json]

For each shape and launch (the shapes and tiles of tests/test_kernel_fp8_gemm.py, with and
without the fp32 promotion every 32 / 128 K: `Fp8GemmConfig.imprecise_acc`) and each out dtype:
the largest absolute error, the largest error relative to the sum of the products' magnitudes
(`scaled_mm_magnitude`: what an accumulator's rounding is bounded by), how many elements fail
a tolerance relative to the result (ATOL + RTOL |ref|: what the tests asked before 2026-12-07,
kept to read the recorded reports alike), their rows, and for bf16 whether the output is the
same launch's fp32 output rounded once (it must be: the kernels differ only in their store).
torch._scaled_mm's error
(fast accumulation on and off) beside them, where the device has it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from pdserve.bench.report import bench_main, config_of, write_report

RTOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
ATOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3}
SHAPES = [(40, 32, 96), (5, 32, 64), (40, 48, 208), (256, 2048, 8192)]
TILES = [(16, 32, 32, 4, 3), (64, 32, 32, 4, 3), (64, 32, 32, 4, 1), (64, 32, 32, 8, 3),
         (64, 128, 128, 4, 4), (128, 128, 128, 8, 3)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", default="bench_results/fp8_gemm_error.json")
    parser.add_argument("--device", default="cuda",
                        help="cuda, or cpu under TRITON_INTERPRET=1 (the small shapes only)")


def operands(m: int, n: int, k: int, seed: int, device: str,
             zero_row: int | None = None) -> list[torch.Tensor]:
    """[xq, x_scale, wq, w_scale] of tests/test_kernel_fp8_gemm.py: rows of growing scale (row
    `zero_row` zeroed), quantized per row / output channel."""
    from engine.quant.fp8 import quantize_weight
    from kernels.fp8 import quantize_rows_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.5, 4.0, m)[:, None]
    if zero_row is not None:
        x[zero_row] = 0.0
    w = torch.randn(n, k, generator=g) * torch.linspace(0.1, 3.0, n)[:, None]
    xq, sx = quantize_rows_ref(x)
    q = quantize_weight(w)
    return [t.to(device) for t in (xq, sx, q.qweight, q.scale)]


def errors(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor,
           dtype: torch.dtype) -> dict[str, Any]:
    diff = (y.float() - ref.float()).abs()
    bad = diff > ATOL[dtype] + RTOL[dtype] * ref.float().abs()
    return {"max_abs": diff.max().item(), "max_rel_to_terms": (diff / magnitude).max().item(),
            "failing": int(bad.sum()), "failing_rows": sorted(set(bad.nonzero()[:, 0].tolist()))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kernels.fp8 import scaled_mm_magnitude, scaled_mm_ref
    from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm

    rows = []
    cuda = args.device.startswith("cuda")
    for m, n, k in SHAPES if cuda else SHAPES[:2]:
        xq, sx, wq, sw = operands(m, n, k, m + k, args.device, zero_row=m // 2)
        magnitude = scaled_mm_magnitude(xq, sx, wq, sw).clamp_min(1e-30)
        refs = {d: scaled_mm_ref(xq, sx, wq, sw, d) for d in RTOL}
        for bm, bn, bk, warps, stages in TILES:
            for acc in (0, 32, 128):
                if acc > bk:  # (tl.dot takes at most its K)
                    continue
                config = Fp8GemmConfig(bm, bn, bk, 1, warps, stages, imprecise_acc=acc)
                outs = {d: fp8_gemm(xq, sx, wq, sw, d, config) for d in RTOL}
                row = {"shape": [m, n, k], "launch": config.label}
                for d, y in outs.items():
                    row[str(d).split(".")[1]] = errors(y, refs[d], magnitude, d)
                row["bf16_is_fp32_rounded"] = bool(torch.equal(
                    outs[torch.bfloat16], outs[torch.float32].to(torch.bfloat16)))
                rows.append(row)
                print(row)
        for fast in (True, False) if cuda else ():  # (kernels/fp8.py `scaled_mm`: True)
            y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1),
                                 out_dtype=torch.float32, use_fast_accum=fast)
            row = {"shape": [m, n, k], "launch": f"torch._scaled_mm use_fast_accum={fast}",
                   "float32": errors(y, refs[torch.float32], magnitude, torch.float32)}
            rows.append(row)
            print(row)
    device = torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter)"
    report = {"config": config_of(args), "device": device, "rows": rows}
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("fp8_gemm_error", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
