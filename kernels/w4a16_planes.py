"""W4A16 for decode batches: y [M, N] = x [M, K] @ W [K, N] on the tensor cores, each int32 of
codes unpacked into eight nibble planes, one dot per plane, no reshape of the codes.

The layout is kernels/w4a16.py's (`qweight` [K / 8, N] int32, nibble j of row i holding W's row
k = 8 i + j; `scales`, `zeros` [K / G, N]); the torch reference is `w4a16_ref` there.

NOTE: grid (M tiles x N tiles, 1, SPLIT_K). A K step is one group of G = BLOCK_K = 128 rows:
the program loads the step's 16 int32 rows of its BLOCK_N columns once, and for each nibble j
takes (q >> 4 j) & 15, a [16, BLOCK_N] tile of codes for W's rows 8 i + j, which multiplies x's
columns k + 8 i + j (a strided [BLOCK_M, 16] load) in one K = 16 dot: the sum over K is taken
in another order (plane by plane), so the codes never change layout (kernels/w4a16.py reshapes
[16, 8, BN] into [128, BN], a trip through shared memory per step). The zeros leave the inner
loop as one term per group, the scales multiply each group's sum once:

    acc[m, n] += s[g, n] * (sum_j x_j[m, :] . q_j[:, n]  -  z[g, n] * sum_{k in g} x[m, k])

The codes 0..15 are exact in bf16 / fp16, the dots accumulate in fp32. SPLIT_K > 1 spreads K
over more programs when M and N give too few (`store_split_k`, as the GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, dot_precision
from kernels.w4a16 import check_inputs, split_k_plan, store_split_k

BLOCK_K = 128  # one group a K step; other group sizes take kernels/w4a16.py


@triton.jit
def _w4a16_planes_kernel(
    x_ptr,  # [M, K] activations
    q_ptr,  # [K / 8, N] int32 packed codes
    s_ptr,  # [K / G, N] fp32 scales
    z_ptr,  # [K / G, N] uint8 zeros
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 dots (the interpreter; fp32 models)
    PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    ri = tl.arange(0, 16)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_stop, 128):  # K is a multiple of 128: no K masks
        packed = tl.load(q_ptr + (k // 8 + ri)[:, None].to(tl.int64) * stride_qk + rn[None, :],
                         mask=n_mask[None, :], other=0)  # [16, BN]
        group_row = (k // 128) * stride_sg  # < 2^31: K / 128 groups x N
        scale = tl.load(s_ptr + group_row + rn, mask=n_mask, other=0.0)  # [BN]
        zero = tl.load(z_ptr + group_row + rn, mask=n_mask, other=0).to(tl.float32)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_rows + (k + 8 * ri + j)[None, :], mask=m_mask[:, None], other=0.0)
            codes = (packed >> (4 * j)) & 0xF  # [16, BN]: W's rows k + 8 i + j
            if UPCAST:
                part += tl.dot(xj.to(tl.float32), codes.to(tl.float32),
                               input_precision=PRECISION)
            else:
                part += tl.dot(xj, codes.to(xj.dtype))
            x_sum += tl.sum(xj.to(tl.float32), axis=1)
        acc += (part - x_sum[:, None] * zero[None, :]) * scale[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    parts = part_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    store_split_k(acc, out, mask, parts, M * N, ticket_ptr + tile, SPLIT_K)


def planes_fit(group_size: int) -> bool:
    """Whether the kernel takes this group size (one group a 128-row K step)."""
    return group_size == BLOCK_K


def w4a16_planes_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, blocks: tuple[int, int, int] | None = None, split_k: int | None = None,
) -> torch.Tensor:
    """[M, K] x the 4-bit W [K, N] -> [M, N] in x's dtype (`w4a16_ref`). `blocks`: (BLOCK_M,
    BLOCK_N, num_warps), by default 16 rows (the dot's least) up to 64 and 64 columns; `split_k`:
    K shares, by default enough to fill the GPU. ValueError for what it cannot take (a group
    size other than 128 among it)."""
    check_inputs("w4a16_planes_linear", x, qweight, scales, zeros, group_size,
                 BLOCK_K if planes_fit(group_size) else None)
    (m, k), n = x.shape, qweight.shape[1]
    block_m, block_n, warps = blocks or (max(16, min(64, triton.next_power_of_2(m))), 64, 4)
    tiles = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    plan = split_k_plan(x, k, BLOCK_K, tiles, split_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    parts, counters = plan.workspace(x, n)
    _w4a16_planes_kernel[plan.flat_grid](
        x, qweight, scales, zeros, out, parts, counters, m, n, k, plan.k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=INTERPRET or x.dtype == torch.float32,
        PRECISION=dot_precision(x.dtype), SPLIT_K=plan.split, num_warps=warps,
    )
    return out
