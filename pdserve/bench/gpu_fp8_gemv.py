"""How an FP8-weight decode GEMV should widen its weights: four ways, timed against the bf16 GEMV.

    PYTHONPATH=. python -m pdserve.bench.gpu_fp8_gemv --out DIR

At batch 1 the FP8 GEMV (kernels/gemv.py with row scales) streams half the bytes of the bf16
one but, measured on an H100 (2026-11-24), moved them at ~1.6-2.1 TB/s against bf16's ~2.5-2.8:
every weight is widened before its multiply-add, and that, not DRAM, may be what bounds it.
This times the M = 1 GEMV over 16 layers' weights of each Llama-3.2-1B projection shape (CUDA
graph replays, engine/cuda_timing.py), for tiles (BLOCK_N, BLOCK_K, warps), with the weight

    cvt     w.to(float32): the hardware conversion (e4m3x2 -> f16x2, then f16 -> f32)
    f16bits the e4m3 bits placed into an fp16 (s eeee mmm -> s 0eeee mmm0000000: the value
            times 2^-8, subnormals included, exactly), then f16 -> f32; 2^8 folded into the scale
    f32bits the bits placed into an fp32 (value times 2^-120; exact unless the GPU flushes fp32
            subnormals), integer ops only; 2^120 folded into the scale
    bf16mul w.to(bfloat16) times x in bf16, accumulated in fp32 (rounds each product)

and reports GB/s, the ratio to bf16's GB/s on the same shape, and the relative error against
`kernels/fp8.py` `w8a16_ref`. `dot` rows: kernels/fp8_dot_gemv.py, no widening at all (x
quantized per token to fp8 beforehand, fp8 x fp8 tensor-core dots; tiles (BLOCK_N, BLOCK_K,
warps, stages, split K), a split K adding fp32 partial sums atomically into a zeroed output,
the zeroing's launch timed with it), error against the same W8A16 reference (so it includes
x's quantization);
`quantize_rows` is the cost of quantizing x in its own launch. `--dot-only` skips the widenings.
JSON to DIR/bench_gpu_fp8_gemv.json.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import triton
import triton.language as tl

from engine.cuda_timing import graph_us
from engine.quant.fp8 import quantize_weight
from kernels.fp8 import w8a16_ref
from kernels.fp8_dot_gemv import fp8_dot_gemv
from kernels.fp8_quant import quantize_rows
from kernels.gemv import GemvBlocks, gemv
from pdserve.bench.report import bench_main, write_report

SHAPES = {"qkv": (3072, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LAYERS = 16
TILES = ((4, 1024, 4), (8, 1024, 4), (4, 2048, 4), (8, 2048, 8), (16, 1024, 8))
DOT_TILES = ((16, 256, 4, 4, 1), (32, 256, 4, 4, 1), (64, 256, 4, 3, 1), (16, 512, 4, 4, 1),
             (16, 256, 4, 4, 2), (32, 256, 4, 4, 2), (32, 256, 4, 4, 4), (64, 256, 4, 3, 4),
             (64, 128, 4, 4, 8), (32, 256, 4, 3, 8), (64, 256, 4, 3, 8), (128, 128, 4, 4, 8))
WIDEN = {"cvt": 0, "f16bits": 1, "f32bits": 2, "bf16mul": 3}
FOLD = {0: 1.0, 1: 2.0 ** 8, 2: 2.0 ** 120, 3: 1.0}  # what each widening leaves in the scale


@triton.jit
def _widen(w, WIDEN: tl.constexpr):
    if WIDEN == 0:
        return w.to(tl.float32)
    u = w.to(tl.uint8, bitcast=True)
    if WIDEN == 1:
        u16 = u.to(tl.uint16)
        bits = ((u16 & 0x80) << 8) | ((u16 & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)
    u32 = u.to(tl.uint32)
    bits = ((u32 & 0x80) << 24) | ((u32 & 0x7F) << 20)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _variant_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        w = tl.load(w_rows + (k + rk)[None, :])
        x = tl.load(x_ptr + k + rk)
        if WIDEN == 3:
            acc += (w.to(tl.bfloat16) * x.to(tl.bfloat16)[None, :]).to(tl.float32)
        else:
            acc += _widen(w, WIDEN) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1) * tl.load(s_ptr + tl.minimum(rn, N - 1))
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


def variant(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int, int],
            widen: int) -> torch.Tensor:
    n, k = q.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _variant_kernel[(triton.cdiv(n, tile[0]),)](
        x, q, scale, out, n, k, BLOCK_N=tile[0], BLOCK_K=tile[1], WIDEN=widen,
        num_warps=tile[2])
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    result: dict[str, Any] = {"layers": LAYERS, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                 for _ in range(LAYERS)]
        quant = [quantize_weight(w) for w in dense]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = min(graph_us([lambda w=w, x=x, t=t: gemv(x, w, None, GemvBlocks(*t))
                                for w in dense]) for t in ((2, 1024, 4), (4, 1024, 4)))
        bf16_gbs = n * k * 2 / bf16_us / 1e3
        row: dict[str, Any] = {"bf16_us": bf16_us, "bf16_GBs": bf16_gbs, "fp8": {}}
        ref = w8a16_ref(x, quant[0].qweight, quant[0].scale)
        xq, sx = quantize_rows(x)
        row["quantize_rows_us"] = graph_us([lambda x=x: quantize_rows(x)] * LAYERS)
        for tile in DOT_TILES:
            if k % (tile[1] * tile[4]):
                continue
            dtype = x.dtype if tile[4] == 1 else torch.float32  # split K: fp32 atomics
            calls = [lambda q=q, t=tile, xq=xq, sx=sx, d=dtype: fp8_dot_gemv(
                xq, sx, q.qweight, q.scale, None, d, *t) for q in quant]
            us = graph_us(calls)
            err = _rel_err(calls[0](), ref)
            gbs = n * k / us / 1e3
            row["fp8"][f"dot {tile}"] = {"us": us, "GBs": gbs, "of_bf16_GBs": gbs / bf16_gbs,
                                         "rel_err": err}
            print(f"{name} dot {tile}: {us:6.1f} us {gbs:6.0f} GB/s "
                  f"({gbs / bf16_gbs:.2f} of bf16's {bf16_gbs:.0f}) err {err:.1e}", flush=True)
        for wname, widen in ({} if args.dot_only else WIDEN).items():
            scales = [q.scale * FOLD[widen] for q in quant]
            for tile in TILES:
                if tile[1] > k:
                    continue
                calls = [lambda q=q, s=s, x=x, t=tile, v=widen: variant(x, q.qweight, s, t, v)
                         for q, s in zip(quant, scales)]
                us = graph_us(calls)
                err = _rel_err(variant(x, quant[0].qweight, scales[0], tile, widen), ref)
                gbs = n * k / us / 1e3
                row["fp8"][f"{wname} {tile}"] = {"us": us, "GBs": gbs,
                                                 "of_bf16_GBs": gbs / bf16_gbs, "rel_err": err}
                print(f"{name} {wname:8s} {tile}: {us:6.1f} us {gbs:6.0f} GB/s "
                      f"({gbs / bf16_gbs:.2f} of bf16's {bf16_gbs:.0f}) err {err:.1e}", flush=True)
        result["shapes"][name] = row
    write_report(result, f"{args.out}/bench_gpu_fp8_gemv.json")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of the JSON report")
    parser.add_argument("--dot-only", action="store_true",
                        help="time only kernels/fp8_dot_gemv.py's tiles besides bf16")


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_fp8_gemv", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
