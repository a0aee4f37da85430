"""W4A16 GEMV over K-major codes, for decode steps of a token or a few: y [M, N] = x [M, K] @ W,
W as `kmajor_layout` holds it (each output column's codes contiguous along K); the reference is
kernels/w4a16.py's `w4a16_ref` on the usual layout.

    qweight_t [N, K / 8] int32   qweight [K / 8, N] transposed: the same int32s, nibble j of
                                 row n, word i the code of k = 8 i + j
    scales_t  [N, K / G] fp32    scales transposed
    zeros_t   [N, K / G] uint8   zeros transposed

NOTE: grid (M, N / BLOCK_N): the shape of kernels/gemv_kloop.py, which streamed FP8 rows at
2.4 TB/s on an H200 where kernels/w4a16_gemv.py's column strips of the K-packed layout reached
1.1-1.6. Each program walks its BLOCK_N rows of W along K in [BLOCK_N, BLOCK_K / 8] steps of
int32 words; for nibble j the codes (kernels/widen.py `nibble_times`) multiply x's entries
k = 8 i + j; each word's group scale and zero come from a gathered [BLOCK_N, BLOCK_K / 8]
tile (one address per group: a step within one group reads one per row), and the zeros fold
in as one term per word:

    acc[n, i] += s[n, g(i)] * (sum_j x[8 i + j] q[n, 8 i + j] - z[n, g(i)] sum_j x[8 i + j])
    y[m, n] = sum_i acc[n, i]                  rounded once to x's dtype

Rows past N are clamped for the loads and dropped at the store; K is a multiple of BLOCK_K
(the launcher checks). Not the layer's path yet: pdserve/bench/gpu_w4a16.py times it beside
kernels/w4a16_gemv.py (`w4a16_kmajor_*`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.w4a16 import ACT_DTYPES, PACK
from kernels.widen import nibble_times

MAX_BLOCK_K = 256  # K a step by default: 128 bytes of codes a row


@triton.jit
def _w4a16_kmajor_kernel(
    x_ptr,  # [M, K] activations, rows contiguous
    q_ptr,  # [N, K / 8] int32 packed codes, rows contiguous
    s_ptr,  # [N, K / G] fp32 scales
    z_ptr,  # [N, K / G] uint8 zeros
    out_ptr,  # [M, N] x's dtype
    N,
    K,
    group_size,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a power of two >= 8: BLOCK_K / 8 words a row a step
):
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None]  # [BN, 1]
    ri = tl.arange(0, BLOCK_K // 8)  # [BW] words of a step
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        packed = tl.load(q_ptr + rows * stride_qn + (k // 8 + ri)[None, :])  # [BN, BW]
        high = (packed >> 20) & 0xFFF  # nibbles 5..7 moved down to bits 0..11
        dots = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        x_sums = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_row + k + 8 * ri + j).to(tl.float32)  # [BW]: x[k + 8 i + j]
            codes = nibble_times(packed if j < 5 else high, j % 5)  # q * 2^(4 (j % 5))
            dots += codes * (xj * 2.0 ** (-4 * (j % 5)))[None, :]
            x_sums += xj
        groups = ((k + 8 * ri) // group_size)[None, :]  # [1, BW]
        scale = tl.load(s_ptr + rows * stride_sn + groups)  # [BN, BW]
        zero = tl.load(z_ptr + rows * stride_sn + groups).to(tl.float32)
        acc += scale * (dots - zero * x_sums[None, :])
    y = tl.sum(acc, axis=1)  # [BN]
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


def kmajor_layout(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/w4a16.py's layout ([K / 8, N], [K / G, N] twice) as this kernel's: the same
    words and groups, each output column's run contiguous."""
    return qweight.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous()


def w4a16_gemv_kmajor(
    x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
    group_size: int, block_n: int = 8, block_k: int | None = None, num_warps: int = 4,
) -> torch.Tensor:
    """[M, K] x the 4-bit W (`kmajor_layout`) -> [M, N] in x's dtype; `block_k` by default the
    largest power of two up to 256 dividing K. ValueError for shapes, strides, dtypes or
    blocks it cannot take."""
    if x.dim() != 2 or qweight_t.dim() != 2 or x.stride(-1) != 1 or qweight_t.stride(-1) != 1:
        raise ValueError("w4a16_gemv_kmajor needs 2-D x and qweight_t with contiguous rows")
    (m, k), (n, words) = x.shape, qweight_t.shape
    block_k = block_k or math.gcd(k, MAX_BLOCK_K)
    groups = k // group_size if group_size > 0 and k % group_size == 0 else -1
    if (x.dtype not in ACT_DTYPES or qweight_t.dtype != torch.int32 or words * PACK != k
            or group_size % PACK or scales_t.shape != (n, groups)
            or scales_t.dtype != torch.float32 or zeros_t.shape != (n, groups)
            or zeros_t.dtype != torch.uint8 or not scales_t.is_contiguous()
            or not zeros_t.is_contiguous() or block_k < PACK or k % block_k
            or block_k & (block_k - 1)):
        raise ValueError(
            f"w4a16_gemv_kmajor: x {tuple(x.shape)} {x.dtype}, qweight_t {tuple(qweight_t.shape)} "
            f"{qweight_t.dtype}, scales_t {tuple(scales_t.shape)} {scales_t.dtype}, zeros_t "
            f"{tuple(zeros_t.shape)} {zeros_t.dtype}, group {group_size}, block_k {block_k}: "
            "need [M, K] fp16/bf16/fp32, [N, K/8] int32, [N, K/G] fp32 and uint8, G a multiple "
            "of 8 dividing K, block_k a power of two >= 8 dividing K")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _w4a16_kmajor_kernel[(m, triton.cdiv(n, block_n))](
        x, qweight_t, scales_t, zeros_t, out, n, k, group_size, x.stride(0),
        qweight_t.stride(0), scales_t.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out
