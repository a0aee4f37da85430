"""GGUF 8-bit-codes GEMM (Q8_0, Q6_K on CUDA): y [M, N] = x [M, K] @ W [K, N], W held as int8
codes with a per-group scale, de-quantized in registers.

    codes  [K, N] int8          Q8_0: q (-128..127); Q6_K: the 6-bit value - 32 (-32..31)
    scales [K / G, N] fp16 / fp32   Q8_0: d, G = 32; Q6_K: d * sc (int8), G = 16

        W[k, n] = codes[k, n] * scales[k // G, n]

NOTE: grid (M tiles, N tiles, SPLIT_K), as kernels/gguf_q4.py: BLOCK_K steps of whole groups,
each [BK, BN] tile de-quantized in fp32 and multiplied in x's dtype (fp32: ieee dots, exact);
split-K shares meet through `store_split_k` (kernels/w4a16.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, dot_precision
from kernels.gguf_q4 import SCALE_DTYPES, block_k_of_groups
from kernels.w4a16 import ACT_DTYPES, split_k_plan, store_split_k


def dequantize_q8_ref(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    g = torch.arange(codes.shape[0], device=codes.device) // group  # -> W [K, N] fp32
    return codes.float() * scales.float()[g]


def gguf_q8_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int
                ) -> torch.Tensor:  # [M, K] -> [M, N] in x's dtype
    return (x.float() @ dequantize_q8_ref(codes, scales, group)).to(x.dtype)


@triton.jit
def _gguf_q8_kernel(
    x_ptr,  # [M, K] activations
    c_ptr,  # [K, N] int8 codes
    s_ptr,  # [K / G, N] fp16/fp32 scales
    out_ptr,  # [M, N] x's dtype
    part_ptr,  # [SPLIT_K, M, N] fp32 workspace (unused if SPLIT_K == 1)
    ticket_ptr,  # [>= M tiles * N tiles] int32 arrival counters, left 0
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_ck,
    stride_sg,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 dot operands (the interpreter; fp32 models)
    PRECISION: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, GROUPS)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_stop, BLOCK_K):  # K is a multiple of BLOCK_K: no K masks
        x = tl.load(x_rows + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)  # [BM, BK]
        c_tile = c_ptr + (k + rk)[:, None].to(tl.int64) * stride_ck + rn[None, :]
        codes = tl.load(c_tile, mask=n_mask[None, :], other=0)  # [BK, BN]
        g_rows = (k // GROUP + rg)[:, None].to(tl.int64) * stride_sg + rn[None, :]
        scale = tl.load(s_ptr + g_rows, mask=n_mask[None, :], other=0.0).to(tl.float32)
        codes = tl.reshape(codes.to(tl.float32), (GROUPS, GROUP, BLOCK_N))
        w = tl.reshape(codes * scale[:, None, :], (BLOCK_K, BLOCK_N))
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    mask = (rm[:, None] < M) & n_mask[None, :]
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    parts = part_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    store_split_k(acc, out, mask, parts, M * N, ticket_ptr + tile, SPLIT_K)


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
           block_k: int | None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or codes.dim() != 2 or codes.stride(-1) != 1:
        raise ValueError("gguf_q8_linear needs 2-D x and codes with contiguous rows")
    (_, k), (kc, n) = x.shape, codes.shape
    groups = k // group if group > 0 and k % group == 0 else -1
    if (x.dtype not in ACT_DTYPES or codes.dtype != torch.int8 or kc != k
            or scales.shape != (groups, n) or scales.dtype not in SCALE_DTYPES
            or not scales.is_contiguous() or block_k is None):
        raise ValueError(
            f"gguf_q8_linear: x {tuple(x.shape)} {x.dtype}, codes {tuple(codes.shape)} "
            f"{codes.dtype}, scales {tuple(scales.shape)} {scales.dtype}, group {group}: need "
            "[M, K] fp16/bf16/fp32, [K, N] int8, [K/G, N] fp16 or fp32, G (16 or 32) dividing K"
        )


def gguf_q8_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """[M, K] x the int8-coded W [K, N] -> [M, N] in x's dtype; see `gguf_q8_ref`. ValueError
    for shapes, strides or dtypes it cannot take."""
    block_k = block_k_of_groups(x.shape[-1], group) if group in (16, 32) else None
    _check(x, codes, scales, group, block_k)
    (m, k), n = x.shape, codes.shape[1]
    block_m, block_n = (16, 64) if m <= 16 else (64, 64)
    tiles = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    plan = split_k_plan(x, k, block_k, tiles, split_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    parts, counters = plan.workspace(x, n)
    _gguf_q8_kernel[plan.grid](
        x, codes, scales, out, parts, counters, m, n, k, plan.k_per_split,
        x.stride(0), codes.stride(0), scales.stride(0), out.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=plan.split,
        UPCAST=INTERPRET or x.dtype == torch.float32, PRECISION=dot_precision(x.dtype),
        num_warps=4,
    )
    return out
