"""GGUF 4-bit GEMM (Q4_0, Q4_1, Q4_K on CUDA): y [M, N] = x [M, K] @ W [K, N], W held as 4-bit
codes with a per-group scale and a per-group float offset, de-quantized in registers.

    qweight [K / 8, N] int32   codes packed along K as in kernels/w4a16.py (`pack_rows`):
                               nibble j of qweight[i, n] is the code of row k = 8 i + j
    scales  [K / G, N] fp16 / fp32
    biases  [K / G, N] fp16 / fp32 (the scales' dtype)

        W[k, n] = code[k, n] * scales[k // G, n] + biases[k // G, n]

GGUF's formats, G = 32 (engine/quant/blocks.py): Q4_0 code = nibble, scale d, bias -8 d;
Q4_1 scale d, bias m; Q4_K scale d * sc, bias -dmin * mn. Unlike W4A16's integer zeros the
offset is a float, so each step de-quantizes its [BK, BN] tile in fp32 and takes one dot in x's
dtype (W rounded to bf16 as a bf16 de-quantized model holds it; fp32 x: exact, ieee dots).

NOTE: grid (M tiles, N tiles, SPLIT_K), like kernels/w4a16.py: each program walks its share of
K in BLOCK_K steps (BLOCK_K a multiple of G, so a step holds BLOCK_K / G whole groups), and
with SPLIT_K > 1 the shares meet through `store_split_k` (a workspace and tickets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, dot_precision
from kernels.w4a16 import ACT_DTYPES, PACK, split_k_plan, store_split_k, unpack_rows

SCALE_DTYPES = (torch.float16, torch.float32)


def dequantize_q4_ref(
    qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int
) -> torch.Tensor:  # -> W [K, N] fp32
    codes = unpack_rows(qweight).float()
    g = torch.arange(codes.shape[0], device=codes.device) // group
    return codes * scales.float()[g] + biases.float()[g]


def gguf_q4_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
    group: int,
) -> torch.Tensor:  # [M, K] -> [M, N] in x's dtype: de-quantize, then an fp32 matmul
    return (x.float() @ dequantize_q4_ref(qweight, scales, biases, group)).to(x.dtype)


@triton.jit
def _gguf_q4_kernel(
    x_ptr,  # [M, K] activations
    q_ptr,  # [K / 8, N] int32 packed codes
    s_ptr,  # [K / G, N] fp16/fp32 scales
    b_ptr,  # [K / G, N] fp16/fp32 biases
    out_ptr,  # [M, N] x's dtype
    part_ptr,  # [SPLIT_K, M, N] fp32 workspace (unused if SPLIT_K == 1)
    ticket_ptr,  # [>= M tiles * N tiles] int32 arrival counters, left 0
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_qk,
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
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # whole groups a step
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    rk = tl.arange(0, BLOCK_K)
    ri = tl.arange(0, BLOCK_K // 8)
    rg = tl.arange(0, GROUPS)
    shifts = tl.arange(0, 8) * 4  # where row 8 i + j sits in int32 i
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_stop, BLOCK_K):  # K is a multiple of BLOCK_K: no K masks
        x = tl.load(x_rows + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)  # [BM, BK]
        q_tile = q_ptr + (k // 8 + ri)[:, None].to(tl.int64) * stride_qk + rn[None, :]
        packed = tl.load(q_tile, mask=n_mask[None, :], other=0)  # [BK / 8, BN]
        g_rows = (k // GROUP + rg)[:, None].to(tl.int64) * stride_sg + rn[None, :]
        scale = tl.load(s_ptr + g_rows, mask=n_mask[None, :], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + g_rows, mask=n_mask[None, :], other=0.0).to(tl.float32)
        codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK / 8, 8, BN]
        codes = tl.reshape(codes, (GROUPS, GROUP, BLOCK_N)).to(tl.float32)
        w = tl.reshape(codes * scale[:, None, :] + bias[:, None, :], (BLOCK_K, BLOCK_N))
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    mask = (rm[:, None] < M) & n_mask[None, :]
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    parts = part_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    store_split_k(acc, out, mask, parts, M * N, ticket_ptr + tile, SPLIT_K)


def block_k_of_groups(k: int, group: int) -> int | None:
    """The K step, whole groups: the largest of 128, 64, 32, 16 that is a multiple of G and
    divides K (kernels/w4a16.py's `block_k_for` is the opposite, a step within one group)."""
    for block in (128, 64, 32, 16):
        if block % group == 0 and k % block == 0:
            return block
    return None


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
           group: int, block_k: int | None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or qweight.dim() != 2 or qweight.stride(-1) != 1:
        raise ValueError("gguf_q4_linear needs 2-D x and qweight with contiguous rows")
    (_, k), (k8, n) = x.shape, qweight.shape
    groups = k // group if group > 0 and k % group == 0 else -1
    if (x.dtype not in ACT_DTYPES or qweight.dtype != torch.int32 or k8 * PACK != k
            or scales.shape != (groups, n) or scales.dtype not in SCALE_DTYPES
            or biases.shape != (groups, n) or biases.dtype != scales.dtype or block_k is None
            or not scales.is_contiguous() or not biases.is_contiguous()):
        raise ValueError(
            f"gguf_q4_linear: x {tuple(x.shape)} {x.dtype}, qweight {tuple(qweight.shape)} "
            f"{qweight.dtype}, scales {tuple(scales.shape)} {scales.dtype}, biases "
            f"{tuple(biases.shape)} {biases.dtype}, group {group}: need [M, K] fp16/bf16/fp32, "
            "[K/8, N] int32, [K/G, N] fp16 or fp32 (one dtype), G (16 or 32) dividing K"
        )


def gguf_q4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
    group: int, split_k: int | None = None,
) -> torch.Tensor:
    """[M, K] x the 4-bit W [K, N] (the layout above) -> [M, N] in x's dtype; see `gguf_q4_ref`.
    `split_k`: K shares, by default enough to fill the GPU at small M. ValueError for shapes,
    strides or dtypes it cannot take."""
    block_k = block_k_of_groups(x.shape[-1], group) if group in (16, 32) else None
    _check(x, qweight, scales, biases, group, block_k)
    (m, k), n = x.shape, qweight.shape[1]
    block_m, block_n = (16, 64) if m <= 16 else (64, 64)
    tiles = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    plan = split_k_plan(x, k, block_k, tiles, split_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    parts, counters = plan.workspace(x, n)
    _gguf_q4_kernel[plan.grid](
        x, qweight, scales, biases, out, parts, counters, m, n, k, plan.k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=plan.split,
        UPCAST=INTERPRET or x.dtype == torch.float32, PRECISION=dot_precision(x.dtype),
        num_warps=4,
    )
    return out
