"""W8A16 GEMM: y [M, N] = x [M, K] @ (Wq [N, K] fp8 * s [N])^T, the weights de-quantized in
registers, the activations kept in their own dtype (bf16 / fp16 / fp32).

NOTE: grid (M tiles, N tiles). Each program walks K in BLOCK_K steps: an x tile [BM, BK], a
weight tile read as fp8 [BK, BN] (half the bytes of bf16) and widened to x's dtype, one dot into
an fp32 accumulator; the per-output-channel scale multiplies the accumulator once at the end
(it is constant along K). The FP8 path for GPUs without fp8 tensor cores (before Ada, 8.9), for
fp16 / fp32 models and for shapes torch._scaled_mm cannot take.

    acc[m, n] = sum_k x[m, k] * float(Wq[n, k]);   y[m, n] = acc[m, n] * s[n]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, dot_precision
from kernels.fp8 import FP8


@triton.jit
def _w8a16_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # [N] fp32 per-output-channel scales
    out_ptr,  # [M, N] x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # widen dot operands to fp32 (the interpreter; fp32 models)
    PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    y = acc * scale[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def w8a16_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """[M, K] x [N, K] fp8 with [N] fp32 scales -> [M, N] in x's dtype; see `w8a16_ref`.
    `blocks`: (BLOCK_M, BLOCK_N, BLOCK_K), by default picked from M (the benchmark tunes)."""
    if x.dim() != 2 or x.stride(-1) != 1 or qweight.stride(-1) != 1:
        raise ValueError("w8a16_linear needs 2-D x and weight with contiguous rows")
    (m, k), (n, k_w) = x.shape, qweight.shape
    if k != k_w or qweight.dtype != FP8 or scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(
            f"w8a16_linear: x {tuple(x.shape)}, weight {tuple(qweight.shape)} {qweight.dtype}, "
            f"scale {tuple(scale.shape)} {scale.dtype}: need [M, K], [N, K] fp8, [N] fp32"
        )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k = blocks or ((16, 32, 128) if m <= 16 else (64, 64, 64))
    upcast = INTERPRET or x.dtype == torch.float32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](
        x, qweight, scale, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
        PRECISION=dot_precision(x.dtype), num_warps=4,
    )
    return out
