"""Fused mixture-of-experts: grouped GEMMs over tokens sorted by expert (vLLM's fused_moe).

NOTE: the T*K (token, k) pairs are sorted by expert and each expert's run padded to BLOCK_M
(kernels/moe_align.py, one launch), so every BLOCK_M tile of the sorted list belongs to one expert:

    topk_ids [T, K] = [[2, 0], [2, 1], [0, 2]]         pairs 0..5 (pair = t * K + k)
    sorted_ids (BLOCK_M 4) = [1, 4, P, P | 3, P, P, P | 0, 2, 5, P]      P = T*K: padding
    tile_experts           = [0,          1,            2]
    num_padded             = 12

One kernel, launched twice with a SiLU-and-mul between:
    gate_up:  C1[pair] = x[pair // K] @ w13[e]^T                  [T*K, 2I]
    down:     C2[pair] = act[pair] @ w2[e]^T * topk_weight[pair]  [T*K, H]
then out[t] = sum_k C2[t * K + k]. A program computes one BLOCK_M x BLOCK_N tile of C: it reads
its BLOCK_M rows of A (gathered through sorted_ids) and expert e's [N, K] weight, so each expert's
weights are read once per tile column, whatever its load. Tiles past num_padded exit at once (the
grid is sized for the worst case, with no host sync: the path is CUDA-graph safe). Pairs whose
expert id is outside [0, E) (another rank's expert) are left out and add nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, dot_precision
from kernels.moe_align import moe_align
from kernels.silu_mul import silu_and_mul

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
TileConfig = tuple[int, int, int, int, int, int]
SMALL_M: TileConfig = (16, 64, 64, 1, 4, 3)  # a few tokens per expert: decode
LARGE_M: TileConfig = (64, 128, 64, 8, 8, 3)  # many tokens per expert: prefill
# Tuned entries: (num_experts, N, K-dim, dtype name, tokens-per-expert bucket) -> config; the
# bucket is tile_config's (2: up to 1 pair per expert, 32: 16..31, 128: 64..127). Measured on an
# H100 80GB HBM3 with triton 3.6 by `python -m pdserve.bench.gpu_moe_tune` (gpu_moe's Mixtral-
# shaped layer, 8 experts top 2, hidden 2048, intermediate 7168, at 1, 64 and 256 tokens:
# docs/results/gpu_moe_tune_h100_2026-11-24.json). Other shapes take the defaults above.
TUNED: dict[tuple[int, int, int, str, int], TileConfig] = {
    (8, 14336, 2048, "bfloat16", 2): (16, 32, 64, 8, 4, 3),  # gate_up, 1 token: 0.055 ms
    (8, 2048, 7168, "bfloat16", 2): (16, 32, 128, 8, 4, 4),  # down, 1 token: 0.039 ms
    (8, 14336, 2048, "bfloat16", 32): (32, 128, 128, 8, 4, 4),  # 64 tokens: 0.175 ms
    (8, 2048, 7168, "bfloat16", 32): (32, 64, 128, 8, 4, 3),  # 0.094 ms
    (8, 14336, 2048, "bfloat16", 128): (64, 128, 128, 8, 4, 4),  # 256 tokens: 0.189 ms
    (8, 2048, 7168, "bfloat16", 128): (64, 64, 64, 8, 4, 4),  # 0.101 ms
}


def tile_config(num_pairs: int, num_experts: int, n: int, k: int, dtype: torch.dtype) -> TileConfig:
    """The tile config for one GEMM ([pairs, k] x [E, n, k]): a tuned entry for this shape if
    any, else the default for its average tokens per expert (small tiles waste less padding at
    decode sizes; narrower columns there give a narrow GEMM enough programs to fill the GPU)."""
    per_expert = num_pairs // max(num_experts, 1)
    bucket = 1 << max(per_expert, 1).bit_length()
    tuned = TUNED.get((num_experts, n, k, str(dtype).removeprefix("torch."), bucket))
    if tuned is not None:
        return tuned
    if per_expert > 32:
        return LARGE_M
    return SMALL_M if n > 4096 else (SMALL_M[0], 32, *SMALL_M[2:])


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [M, Kd]: x [T, H] (gate_up: row = pair // TOP_K) or act [T*K, I] (down: row = pair)
    b_ptr,  # [E, N, Kd]: stacked expert weights (w13 or w2)
    c_ptr,  # [T*K, N] out, row = pair
    weights_ptr,  # [T*K] routing weights, any float dtype (read when MUL_WEIGHT)
    sorted_ids_ptr,  # [P] int32 pairs sorted by expert, padded with num_pairs
    tile_experts_ptr,  # [P / BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    N,
    Kd,
    num_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    TOP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # grouped ordering: GROUP_M row tiles share their column tiles while B is in L2
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.num_programs(0) // tiles_n
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)  # [M]
    valid = pairs < num_pairs
    rows = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(tile_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [M, BK]
    b_ptrs = (
        b_ptr
        + expert * stride_be
        + offs_n[None, :].to(tl.int64) * stride_bn
        + offs_k[:, None] * stride_bk
    )  # [BK, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, Kd, BLOCK_K):
        k_mask = offs_k < Kd - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(
    a: torch.Tensor,  # [M, Kd]
    b: torch.Tensor,  # [E, N, Kd]
    c: torch.Tensor,  # [num_pairs, N]
    weights: torch.Tensor | None,  # [num_pairs]
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # moe_align's
    num_pairs: int,
    top_k: int,
    config: TileConfig,
) -> None:
    """c[pair] = a[pair // top_k] @ b[expert(pair)]^T (* weights[pair]) for every routed pair."""
    _, n, kd = b.shape
    block_m, block_n, block_k, group_m, warps, stages = config
    sorted_ids, tile_experts, num_padded = aligned
    grid = (tile_experts.numel() * triton.cdiv(n, block_n),)
    _fused_moe_kernel[grid](
        a,
        b,
        c,
        weights if weights is not None else c,
        sorted_ids,
        tile_experts,
        num_padded,
        n,
        kd,
        num_pairs,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        TOP_K=top_k,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        DOT_PRECISION=dot_precision(a.dtype),
        UPCAST=INTERPRET,
        num_warps=warps,
        num_stages=stages,
    )


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]; ids outside [0, E) add nothing
    config: TileConfig | None = None,  # both GEMMs' (None: tile_config's choice for each)
) -> torch.Tensor:  # [T, H]
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k].

    Six launches (align, GEMM, SiLU-and-mul, zero-fill, GEMM, sum) and no host sync: the
    path can be captured in a CUDA graph."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k, pairs = topk_ids.shape[1], topk_ids.numel()
    if num_tokens == 0:
        return torch.zeros_like(x)
    up_cfg = config or tile_config(pairs, num_experts, two_i, hidden, x.dtype)
    down_cfg = config or tile_config(pairs, num_experts, hidden, two_i // 2, x.dtype)
    down_cfg = (up_cfg[0], *down_cfg[1:])  # one BLOCK_M: both GEMMs share the alignment
    if INTERPRET:  # small tiles keep the interpreter's numpy arrays small
        up_cfg, down_cfg = (16, 16, 16, *up_cfg[3:]), (16, 16, 16, *down_cfg[3:])
    aligned = moe_align(topk_ids, num_experts, up_cfg[0])
    alloc = torch.zeros if INTERPRET else torch.empty  # numpy warns on garbage rows' overflow
    gate_up = alloc(pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, aligned, pairs, top_k, up_cfg)
    act = silu_and_mul(gate_up)  # [T*K, I]; rows of left-out pairs hold garbage, never read
    down = torch.zeros(pairs, hidden, dtype=x.dtype, device=x.device)  # left-out rows: 0
    _grouped_gemm(act, w2, down, topk_weights.contiguous(), aligned, pairs, 1, down_cfg)
    if top_k == 1:
        return down
    return down.view(num_tokens, top_k, hidden).sum(dim=1)  # accumulates in fp32


def _check_shapes(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"expert shapes {tuple(w13.shape)} / {tuple(w2.shape)} do not fit hidden {hidden}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / topk_weights "
            f"{tuple(topk_weights.shape)} do not fit {num_tokens} tokens"
        )
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x is {x.dtype}, experts are {w13.dtype} / {w2.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights need contiguous rows")


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:  # [T, H] in fp32
    """Reference: every (token, k) pair on its own, in fp32; ids outside [0, E) add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e].float() @ x[t].float()).chunk(2)
                act = torch.nn.functional.silu(gate) * up  # [I]
                out[t] += float(topk_weights[t, k]) * (w2[e].float() @ act)
    return out
