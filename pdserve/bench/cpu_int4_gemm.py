"""torch's packed int4 CPU GEMM against de-quantize + bf16 matmul and a plain bf16 matmul.

    python -m pdserve.bench.cpu_int4_gemm [--shapes 3072x576,576x1536,960x576] [--rows 1,32,...]

For each weight shape N x K (default: the bundled SmolLM2's fused gate_up, down and qkv) and
each row count M of x (bf16): `_weight_int4pack_mm_for_cpu` (engine/quant/kernels.py
`Int4PackKernel`), `dense_weight_t` + matmul (engine/quant/int4_dense.py, what steps of
DENSE_MIN_TOKENS rows or more run), a bf16 `F.linear` on a dense weight held in memory (the
bound of the second), and the de-quantization alone; medians of `--repeats` timed calls after
two untimed ones, milliseconds, with the GFLOP/s of each matmul. Random nibbles and scales:
the timings do not depend on the values.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.quant.int4_dense import dense_supported, dense_weight_t
from engine.quant.kernels import Int4PackKernel, int4pack_available
from pdserve.bench.report import bench_main, config_of, median_wall_ms, write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="3072x576,576x1536,960x576", help="N x K, comma-separated")
    p.add_argument("--rows", default="1,8,32,128,256,512,2048", help="M values, comma-separated")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--output-json", default="bench_results/cpu_int4_gemm.json")


def _ms(fn: Callable[[], Any], repeats: int) -> float:
    return median_wall_ms(fn, repeats, warmup=2)


def _row(n: int, k: int, m: int, packed: torch.Tensor, sz: torch.Tensor, w: torch.Tensor,
         dense: bool, dequant_ms: float | None, repeats: int) -> dict[str, Any]:
    x = torch.randn(m, k).bfloat16()
    row = {"n": n, "k": k, "m": m, "dequant_ms": dequant_ms,
           "int4_ms": _ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz),
                          repeats),
           "bf16_ms": _ms(lambda: F.linear(x, w), repeats),
           "dense_path_ms": _ms(lambda: x @ dense_weight_t(packed, sz), repeats) if dense else None}
    flop = 2 * m * n * k / 1e9
    row["int4_gflops"] = flop / row["int4_ms"] * 1e3
    row["bf16_gflops"] = flop / row["bf16_ms"] * 1e3
    dense_s = "-" if not dense else f"{row['dense_path_ms']:.3f}"
    print(f"{n:>6}x{k:<5} M {m:>5}  int4 {row['int4_ms']:8.3f} ms ({row['int4_gflops']:4.0f} "
          f"GFLOP/s)  de-quantize+mm {dense_s:>8}  bf16 {row['bf16_ms']:8.3f} "
          f"({row['bf16_gflops']:4.0f})  de-quantize alone "
          f"{'-' if dequant_ms is None else format(dequant_ms, '.3f')}")
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not int4pack_available():
        raise ValueError("this torch has no packed int4 CPU GEMM")
    rows = [int(m) for m in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        kernel = Int4PackKernel(torch.randint(0, 16, (n, k), generator=g),
                                torch.rand(n, k // 32, generator=g) * 0.01,
                                torch.rand(n, k // 32, generator=g) * 0.01)
        packed, sz, w = kernel.packed, kernel.scales_and_zeros, torch.randn(n, k).bfloat16()
        dense = dense_supported(packed)
        dequant_ms = (_ms(lambda p=packed, s=sz: dense_weight_t(p, s), args.repeats)
                      if dense else None)
        for m in rows:
            results.append(_row(n, k, m, packed, sz, w, dense, dequant_ms, args.repeats))
    report = {"config": config_of(args), "threads": torch.get_num_threads(), "rows": results}
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("cpu_int4_gemm", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
