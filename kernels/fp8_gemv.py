"""FP8-weight GEMV for decode steps of a few tokens: y [M, N] = x [M, K] @ (Wq [N, K] * s)^T.

NOTE: grid (M, N / BLOCK_N). Batch-1 decode reads every weight once per token and does almost
no arithmetic on it, so what counts is bytes in flight: many small programs (BLOCK_N rows of W
each, >= ~4 per SM at the model's widths), each streaming its rows in BLOCK_K chunks of fp8 (half
of bf16's bytes) against one x row, reduced with a sum, not a tensor-core dot (a dot pads M to
16 and torch._scaled_mm's tiles leave SMs idle: 128-wide tiles over N = 2048 make 16 programs).
Rows of x beyond the first re-read W (from L2): for M <= GEMV_MAX_TOKENS only.

    y[m, n] = s[n] * sum_k x[m, k] * float(Wq[n, k])
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8
from kernels.widen import widen

GEMV_MAX_TOKENS = 4


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # [N] fp32 per-output-channel scales
    out_ptr,  # [M, N] x's dtype
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += widen(w) * x[None, :]
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    y = tl.sum(acc, axis=1) * scale
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


def fp8_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """[M, K] x [N, K] fp8 with [N] fp32 scales -> [M, N] in x's dtype (kernels/fp8.py
    `w8a16_ref`). `blocks`: (BLOCK_N, BLOCK_K); by default enough programs to fill the GPU."""
    if x.dim() != 2 or x.stride(-1) != 1 or qweight.stride(-1) != 1:
        raise ValueError("fp8_gemv needs 2-D x and weight with contiguous rows")
    (m, k), (n, k_w) = x.shape, qweight.shape
    if k != k_w or qweight.dtype != FP8 or scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(
            f"fp8_gemv: x {tuple(x.shape)}, weight {tuple(qweight.shape)} {qweight.dtype}, "
            f"scale {tuple(scale.shape)} {scale.dtype}: need [M, K], [N, K] fp8, [N] fp32"
        )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if blocks is None:
        block_n = 16 if n >= 8192 else 4
        blocks = (block_n, min(4096 // block_n, triton.next_power_of_2(k)))
    block_n, block_k = blocks
    _fp8_gemv_kernel[(m, triton.cdiv(n, block_n))](
        x, qweight, scale, out, n, k, x.stride(0), qweight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out
