"""The decode profile's GEMM sweep (pdserve/bench/gpu_decode_profile.py, step 2): each projection
shape of the model at M = 1, 2, 4 tokens, every layer's weight in turn from a CUDA graph, cuBLAS
against the GEMV's tiles and the fused kernels, timed as engine/models/gemv_plan.py times them.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cuda_timing import graph_us
from engine.models.gemv_calls import linear_calls, norm_calls, silu_calls
from engine.models.gemv_plan import NORM_ROWS, _normed_weights
from kernels.gemv import GemvBlocks
from pdserve.bench.gpu_model import log

SWEEP: dict[int, tuple[GemvBlocks, ...]] = {
    1: tuple(GemvBlocks(*b) for b in [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (4, 2048, 8),
                                      (8, 256, 4), (8, 512, 8), (16, 256, 8), (16, 128, 4),
                                      (2, 2048, 8)]),
    2: tuple(GemvBlocks(*b) for b in [(4, 512, 4), (4, 256, 4), (8, 256, 4), (8, 256, 8),
                                      (2, 1024, 8), (4, 1024, 8)]),
    4: tuple(GemvBlocks(*b) for b in [(4, 256, 4), (2, 512, 4), (8, 256, 8), (4, 512, 8),
                                      (8, 128, 4), (2, 1024, 8)]),
}
SILU_SWEEP = {1: SWEEP[1][:2] + SWEEP[1][4:6] + SWEEP[1][8:], 2: SWEEP[2][:3], 4: SWEEP[4][:3]}


def copy_rate(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device copy (the bench's ceiling)."""
    from pdserve.bench.gpu_kernels import _copy_ms

    return 2 * (1 << 30) / (_copy_ms(1 << 30, device) * 1e-3)


def shapes_of(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    layers = model.model.layers
    return {"qkv": [lyr.self_attn.qkv_proj.weight for lyr in layers],
            "o_proj": [lyr.self_attn.o_proj.weight for lyr in layers],
            "gate_up": [lyr.mlp.gate_up_proj.weight for lyr in layers],
            "down": [lyr.mlp.down_proj.weight for lyr in layers],
            "lm_head": [model.model.embed_tokens.weight]}


def sweep_gemms(model: torch.nn.Module, rate: float, sweep: bool) -> list[dict[str, Any]]:
    """Per shape and M: cuBLAS and every swept tile, microseconds per call."""
    rows, normed = [], _normed_weights(model)
    for name, weights in shapes_of(model).items():
        nbytes = weights[0].nbytes
        for m in (1, 2, 4):
            row: dict[str, Any] = {"shape": name, "n_k": tuple(weights[0].shape), "m": m,
                                   "bytes": nbytes, "cublas_us": graph_us(
                                       linear_calls(weights, m, None))}
            tiles = SWEEP[m] if sweep and m == 1 else ()  # cuBLAS won M = 2, 4 by far
            row["gemv_us"] = {str(tuple(b)): graph_us(fns) for b in tiles
                              if (fns := linear_calls(weights, m, b))}
            if name == "down":
                row["silu_down_us"] = graph_us(silu_calls(weights, m, None))
                row["gemv_silu_us"] = {str(tuple(b)): graph_us(silu_calls(weights, m, b))
                                       for b in (SILU_SWEEP[m] if sweep and m == 1 else ())}
            pairs = normed.get(tuple(weights[0].shape))
            if pairs and m == 1 and name in ("qkv", "gate_up"):
                k = weights[0].shape[1]
                row["norm_linear_us"] = graph_us(norm_calls(pairs, m, None))
                row["gemv_norm_us"] = {str((bn, k, wp)): graph_us(norm_calls(
                    pairs, m, GemvBlocks(bn, k, wp))) for bn, wp in (NORM_ROWS if sweep else ())}
            row["cublas_frac"] = nbytes / (row["cublas_us"] * 1e-6) / rate
            if row["gemv_us"]:
                best = min(row["gemv_us"], key=row["gemv_us"].get)
                row.update(best_tile=best, best_us=row["gemv_us"][best],
                           best_frac=nbytes / (row["gemv_us"][best] * 1e-6) / rate)
            log(f"  {name} M{m}: cublas {row['cublas_us']:.1f} us, best "
                f"{row.get('best_tile')} {row.get('best_us', float('nan')):.1f} us")
            rows.append(row)
    return rows
