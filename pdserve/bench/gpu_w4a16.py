"""The W4A16 Triton kernels (kernels/w4a16.py's GEMM, w4a16_gemv.py, w4a16_planes.py) against
bf16 F.linear on Llama-3.2-1B's projection shapes, 1 to 64 tokens at a time (decode batches):
device ms per call replayed in a CUDA graph, the kernels' tile and split-K variants, and the
weight-bytes floor at the measured copy bandwidth. Each timed call cycles through copies of its
weights, 4x the L2 in all, so that it reads them from DRAM as a decode step does (before
2026-12-03 one copy was timed: up to 17 MB, from the 50 MB L2 of an H100 or H200).

    python -m pdserve.bench.gpu_w4a16 --out DIR          # on a GPU (device call: gpu_kit_env.sh)
    python -m pdserve.bench.gpu_w4a16 --small --out DIR  # the same code on the CPU, tiny shapes

Writes DIR/gpu_w4a16.json and prints one line per (shape, M).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# name "K x N" (in x out features): (N, K), HF's [out, in]; Llama-3.2-1B's fused qkv, o, fused
# gate_up, down
SHAPES = {"qkv 2048x3072": (3072, 2048), "o 2048x2048": (2048, 2048),
          "gate_up 2048x16384": (16384, 2048), "down 8192x2048": (2048, 8192)}
SMALL_SHAPES = {"128x64": (64, 128), "256x128": (128, 256)}
TOKENS = (1, 2, 4, 8, 16, 32, 64)
SMALL_TOKENS = (1, 5)
# nibble-plane kernel (BLOCK_N, num_warps); BLOCK_M follows M (16..64)
PLANE_TILES = tuple((n, w) for n in (32, 64, 128) for w in (4, 8))
TILES = ((16, 32), (16, 64), (16, 128))  # GEMM (BLOCK_M, BLOCK_N)
# GEMV (BLOCK_N, max ROWS, num_warps)
GEMV_TILES = ((16, 16, 1), (32, 16, 2), (64, 16, 4), (16, 32, 1), (32, 32, 2), (32, 32, 4),
              (64, 32, 4), (32, 64, 2), (32, 64, 4), (64, 64, 4))
SPLITS = (1, 2, 4, 8, 16)
# the pairs loop's variants: as it is, with Triton's software pipeline (three steps), and the
# codes' tiles by TMA descriptor (one, three or four steps in flight)
PAIR_VARIANTS = {"": {}, "_st3": {"stages": 3}, "_tma1": {"tma": True},
                 "_tma3": {"tma": True, "stages": 3}, "_tma4": {"tma": True, "stages": 4}}
GROUP = 128


def device_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median device ms of one call replayed in a CUDA graph (the CPU: host ms, 3 calls)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - start) / 3 * 1e3
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes per second of a 1 GiB device-to-device copy (None on the CPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = device_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms * 1e-3)


def _layer(n: int, k: int, device: torch.device, group: int) -> tuple[Any, torch.Tensor]:
    from engine.quant.w4a16 import dequantize
    from engine.quant.w4a16_linear import W4A16Linear
    from engine.quant.w4a16_quantize import quantize

    w = quantize(torch.randn(n, k) * 0.02, group, symmetric=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: keep qweight
    layer = W4A16Linear(k, n, bias=False).to(device=device, dtype=dtype)
    layer.weight.weight_loader(layer.weight, slice(None), w, "w")
    return layer, dequantize(w).to(device)


def _variants(m: int, x: torch.Tensor, layer: Any, group: int, cuda: bool, gemv_only: bool,
              gemv_tiles: tuple[tuple[int, int, int], ...] = GEMV_TILES
              ) -> dict[str, Callable[[], torch.Tensor]]:
    """Name -> call: the layer (its default path), every GEMM tile and split (unless
    `gemv_only`), and for M <= GEMV_MAX_TOKENS every GEMV tile (of `gemv_tiles`) and split,
    its fp32 loop and (16-bit x) its codes in pairs (`_pairs`, pipelined `_pairs_st3`)."""
    from kernels.w4a16 import w4a16_linear
    from kernels.w4a16_gemv import GEMV_MAX_TOKENS, w4a16_gemv
    from kernels.w4a16_planes import planes_fit, w4a16_planes_linear

    args = (layer.qweight, layer.scales, layer.zeros, group)
    calls: dict[str, Callable[[], torch.Tensor]] = {"w4a16_auto": lambda: layer(x)}
    for tile in () if gemv_only else TILES if cuda else TILES[:1]:
        for split in SPLITS if cuda else SPLITS[:2]:
            calls[f"w4a16_{tile[0]}x{tile[1]}_s{split}"] = \
                lambda t=tile, s=split: w4a16_linear(x, *args, t, s)
    block_m = max(16, min(64, 1 << (m - 1).bit_length()))
    planes = planes_fit(group) and not gemv_only
    for block_n, warps in (PLANE_TILES if cuda else PLANE_TILES[:1]) if planes else ():
        for split in (None, *SPLITS) if cuda else (None,):
            calls[f"w4a16_planes_{block_m}x{block_n}w{warps}_s{split or 'auto'}"] = \
                lambda t=(block_m, block_n, warps), s=split: w4a16_planes_linear(x, *args, t, s)
    for tile in (gemv_tiles if cuda else gemv_tiles[:1]) if m <= GEMV_MAX_TOKENS else ():
        for split in SPLITS[:4] if cuda else SPLITS[:2]:
            name = f"w4a16_gemv_{tile[0]}r{tile[1]}w{tile[2]}_s{split}"
            calls[name] = lambda t=tile, s=split: w4a16_gemv(x, *args, t, s, pairs=False)
            if x.dtype != torch.float32:  # codes in pairs (kernels/nibble_pairs.py)
                for suffix, more in PAIR_VARIANTS.items() if cuda else (("", {}),):
                    calls[f"{name}_pairs{suffix}"] = \
                        lambda t=tile, s=split, kw=more: w4a16_gemv(x, *args, t, s, pairs=True,
                                                                    **kw)
    return calls


def copies_beyond_l2(nbytes: int, device: torch.device) -> int:
    """How many copies of `nbytes` of weights a timed call cycles through so that each call
    reads its weights from DRAM, as a decode step does (the model is larger than the L2):
    4x the L2 in all, at most 64 (1 on the CPU)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(64, -(-4 * l2 // nbytes)))


def cycled_ms(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Device ms of one call of `calls` (one per weight copy), the whole cycle replayed."""
    return device_ms(lambda: [call() for call in calls], device) / len(calls)


def shape_rows(name: str, n: int, k: int, device: torch.device, group: int,
               bandwidth: float | None, tokens: tuple[int, ...], gemv_only: bool = False,
               gemv_tiles: tuple[tuple[int, int, int], ...] = GEMV_TILES
               ) -> list[dict[str, Any]]:
    layer, exact = _layer(n, k, device, group)
    layers = [layer] + [copy.deepcopy(layer) for _ in
                        range(copies_beyond_l2(layer.weight_bytes(), device) - 1)]
    dense = exact.to(torch.bfloat16)
    denses = [dense] + [dense.clone() for _ in
                        range(copies_beyond_l2(dense.nbytes, device) - 1)]
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        expected = x.float() @ exact.t()
        row: dict[str, Any] = {
            "shape": name, "n": n, "k": k, "m": m, "weight_copies": len(layers),
            "bf16_linear_ms": cycled_ms([lambda x=x, w=w: F.linear(x, w) for w in denses],
                                        device)}
        errors = {}
        per_copy = [_variants(m, x, each, group, device.type == "cuda", gemv_only, gemv_tiles)
                    for each in layers]
        for label, call in per_copy[0].items():
            try:  # a variant the GPU's compiler refuses is reported, the others still timed
                out = call()
            except Exception as exc:  # noqa: BLE001
                row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{name} M={m}: {label} failed: {row[f'{label}_error']}", flush=True)
                continue
            errors[label] = ((out.float() - expected).norm() / expected.norm()).item()
            row[f"{label}_ms"] = cycled_ms([calls[label] for calls in per_copy], device)
        row["rel_err"] = errors["w4a16_auto"]
        row["max_variant_rel_err"] = max(errors.values())
        variants = {key: v for key, v in row.items()
                    if key.startswith("w4a16_") and key.endswith("_ms")}
        row["best"] = min(variants, key=variants.get)
        w4_bytes = layer.weight_bytes()
        row["bytes"] = {"bf16": dense.nbytes, "w4a16": w4_bytes}
        if bandwidth:
            row["floor_ms"] = {"bf16": dense.nbytes / bandwidth * 1e3,
                               "w4a16": w4_bytes / bandwidth * 1e3}
        rows.append(row)
        print(f"{name} M={m}: bf16 {row['bf16_linear_ms']:.4f} ms, w4a16 (auto) "
              f"{row['w4a16_auto_ms']:.4f} ms, best {row['best']} {variants[row['best']]:.4f} "
              f"ms, rel err {row['rel_err']:.2e} (all variants <= "
              f"{row['max_variant_rel_err']:.2e})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="tiny shapes (the CPU)")
    parser.add_argument("--tokens", default=None, help="comma-separated M (default 1 to 64)")
    parser.add_argument("--gemv-only", action="store_true",
                        help="time the layer and the GEMV's variants only (no GEMM tiles)")
    parser.add_argument("--gemv-tiles", default=None,
                        help="GEMV tiles BLOCK_NxROWSxWARPS, comma-separated (default: all)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shapes, tokens = (SMALL_SHAPES, SMALL_TOKENS) if args.small else (SHAPES, TOKENS)
    if args.tokens:
        tokens = tuple(int(m) for m in args.tokens.split(","))
    gemv_tiles = GEMV_TILES if not args.gemv_tiles else tuple(
        tuple(int(v) for v in tile.split("x")) for tile in args.gemv_tiles.split(","))
    group = GROUP
    bandwidth = copy_bandwidth(device)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "group_size": group, "copy_bandwidth_bytes_per_s": bandwidth, "rows": []}
    for name, (n, k) in shapes.items():
        report["rows"] += shape_rows(name, n, k, device, group, bandwidth, tokens,
                                     args.gemv_only, gemv_tiles)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_w4a16.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
