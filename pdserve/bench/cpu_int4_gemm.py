"""The CPU GEMMs over GGUF codes against each other and against a plain bf16 matmul.

    python -m pdserve.bench.cpu_int4_gemm [--shapes 3072x576,576x1536,960x576] [--rows 1,32,...]
        [--q8-shapes 49152x576] [--threads N]

For each weight shape N x K (default: the bundled SmolLM2's fused gate_up, down and qkv, all
Q4_1) and each row count M of x (bf16), milliseconds, medians of `--repeats` timed calls after
two untimed ones, with the GFLOP/s of each matmul:

    nibble        kernels/cpu_nibble.c (engine/quant/kernels.py `NibbleKernel`, what runs where
                  the CPU has AVX512-BF16), the weights hot in the caches
    nibble_mem    the same over enough copies of the weights (>= --stream-mib) called in turn,
                  as a decode step streams its layers from memory
    int4          torch's `_weight_int4pack_mm_for_cpu` (`Int4PackKernel`, the fallback), and
    int4_mem      the same streamed
    dense_path    de-quantize to bf16 + matmul (what steps of DENSE_MIN_TOKENS rows or more run;
                  the nibble kernel's de-quantization, else torch's packing read back)
    bf16          `F.linear` on a dense bf16 weight held in memory: the bound of the dense path

`--q8-shapes` (default the tied Q8_0 lm_head) times Q8_0: the nibble kernel against
`SplitInt8Kernel` (two int4 GEMMs). Random codes and scales: the timings do not depend on the
values.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from engine.quant.blocks import QuantWeight
from engine.quant.int4_dense import dense_supported, dense_weight_t
from engine.quant.kernels import Int4PackKernel, NibbleKernel, SplitInt8Kernel, int4pack_available
from kernels import cpu_nibble
from pdserve.bench.report import bench_main, config_of, median_wall_ms, write_report

Q = GGMLQuantizationType


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="3072x576,576x1536,960x576",
                   help="Q4 weights, N x K, comma-separated")
    p.add_argument("--q8-shapes", default="49152x576", help="Q8_0 weights, N x K ('' for none)")
    p.add_argument("--rows", default="1,4,8,32,128,256,512,2048",
                   help="M values, comma-separated")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--stream-mib", type=float, default=96.0,
                   help="the *_mem columns cycle through this many MiB of weight copies")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--output-json", default="bench_results/cpu_int4_gemm.json")


def _ms(fn: Callable[[], Any], repeats: int) -> float:
    return median_wall_ms(fn, repeats, warmup=2)


def _streamed_ms(kernels: list[Callable[[torch.Tensor], Any]], x: torch.Tensor,
                 repeats: int) -> float:
    """Median ms of one call, each call on the next copy of the weights."""
    turn = iter(range(1 << 62))
    return _ms(lambda: kernels[next(turn) % len(kernels)](x), repeats)


def _random_weight(qtype: GGMLQuantizationType, n: int, k: int, g: torch.Generator
                   ) -> QuantWeight:
    if qtype == Q.Q8_0:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        return QuantWeight(qtype, codes, torch.rand(n, k // 32, generator=g) * 1e-3, None, 32)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    return QuantWeight(qtype, codes, torch.rand(n, k // 32, generator=g) * 0.01,
                       -torch.rand(n, k // 32, generator=g) * 0.05, 32)


def _torch_kernel(w: QuantWeight) -> Int4PackKernel | SplitInt8Kernel:
    if w.qtype == Q.Q8_0:
        return SplitInt8Kernel(w)
    return Int4PackKernel.from_quant(w)


def _nibble_call(kernel: NibbleKernel) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: kernel.gemm(x, torch.bfloat16)


def _shape(qtype: GGMLQuantizationType, n: int, k: int, rows: list[int], args: argparse.Namespace,
           g: torch.Generator) -> list[dict[str, Any]]:
    w = _random_weight(qtype, n, k, g)
    bytes_held = w.codes.numel() * (1 if qtype == Q.Q8_0 else 0.5)
    copies = max(2, math.ceil(args.stream_mib * 2**20 / bytes_held))
    nibble = [NibbleKernel(w) for _ in range(copies)] if cpu_nibble.available() else []
    torch_k = [_torch_kernel(w) for _ in range(copies)] if int4pack_available() else []
    dense = torch.randn(n, k).bfloat16()
    return [_row(qtype, n, k, m, nibble, torch_k, dense, args.repeats) for m in rows]


def _row(qtype: GGMLQuantizationType, n: int, k: int, m: int, nibble: list[NibbleKernel],
         torch_k: list[Int4PackKernel | SplitInt8Kernel], dense: torch.Tensor, repeats: int
         ) -> dict[str, Any]:
    x = torch.randn(m, k).bfloat16()
    row: dict[str, Any] = {"format": qtype.name, "n": n, "k": k, "m": m,
                           "bf16_ms": _ms(lambda: F.linear(x, dense), repeats)}
    if nibble:
        one = nibble[0]
        row["nibble_ms"] = _ms(lambda: _nibble_call(one)(x), repeats)
        row["nibble_mem_ms"] = _streamed_ms([_nibble_call(kn) for kn in nibble], x, repeats)
        row["dense_path_ms"] = _ms(lambda: x @ one.dense_t(), repeats)
    if torch_k:
        first = torch_k[0]
        row["int4_ms"] = _ms(lambda: first(x), repeats)
        row["int4_mem_ms"] = _streamed_ms(torch_k, x, repeats)
        if not nibble and isinstance(first, Int4PackKernel) and dense_supported(first.packed):
            row["dense_path_ms"] = _ms(
                lambda: x @ dense_weight_t(first.packed, first.scales_and_zeros), repeats)
    flop = 2 * m * n * k / 1e9
    cells = []
    for name in ("nibble", "nibble_mem", "int4", "int4_mem", "dense_path", "bf16"):
        ms = row.get(f"{name}_ms")
        if ms is not None:
            row[f"{name}_gflops"] = flop / ms * 1e3
            cells.append(f"{name} {ms:7.3f}")
    if "nibble_ms" in row and "int4_ms" in row:
        row["int4_over_nibble"] = row["int4_ms"] / row["nibble_ms"]
        row["int4_mem_over_nibble_mem"] = row["int4_mem_ms"] / row["nibble_mem_ms"]
        cells.append(f"torch/nibble {row['int4_over_nibble']:.2f}x "
                     f"(streamed {row['int4_mem_over_nibble_mem']:.2f}x)")
    print(f"{qtype.name:5} {n:>6}x{k:<5} M {m:>5}  " + "  ".join(cells), flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not int4pack_available() and not cpu_nibble.available():
        raise ValueError("neither torch's packed int4 CPU GEMM nor kernels/cpu_nibble runs here")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    results = []
    for qtype, shapes in ((Q.Q4_1, args.shapes), (Q.Q8_0, args.q8_shapes)):
        for shape in filter(None, shapes.split(",")):
            n, k = (int(v) for v in shape.split("x"))
            results += _shape(qtype, n, k, rows, args, g)
    report = {"config": config_of(args), "threads": torch.get_num_threads(),
              "nibble": cpu_nibble.available(), "rows": results}
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("cpu_int4_gemm", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
