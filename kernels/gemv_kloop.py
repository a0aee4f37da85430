"""GEMV in the K-loop shape for decode steps of a few tokens: y [M, N] = x [M, K] @ W [N, K]^T
(* s) (+ b), one token row per program (kernels/gemv.py's `GemvBlocks(..., kloop=True)`).

NOTE: grid (M, cdiv(N, BLOCK_N)). The shape of kernels/fp8_gemv.py and of the fused gate_up's
K loop (kernels/gemv_rmsnorm_swiglu.py), the ones that streamed FP8 rows fastest on an H200:
each program walks its BLOCK_N rows of W in short [BLOCK_N, BLOCK_K] steps against one row of
x, multiply-adds into a tile of partial sums, and reduces it once at the end. kernels/gemv.py
keeps all M rows of x in a [M, BLOCK_N, BLOCK_K] product instead, so W crosses DRAM once for
any M; here rows of x beyond the first re-read W from L2 (M <= GEMV_MAX_TOKENS).

    acc[n, :] += widen(W[n, k:k+BK]) * x[m, k:k+BK]     for k in 0, BK, ..., K - BK
                                                        (k = 0 peeled: its W tile is requested
                                                         before a PDL launch waits for x)
    y[m, n] = sum(acc[n, :]) (* s[n]) (+ b[n]), rounded once to x's dtype

Rows past N are clamped to N - 1 for the loads and dropped at the store; K is a multiple of
BLOCK_K (the launcher in kernels/gemv.py checks). FP8 weights widen by kernels/widen.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.widen import widen


@triton.jit
def _gemv_kloop_kernel(
    x_ptr,  # [M, K] activations, rows contiguous
    w_ptr,  # [N, K] weight, rows contiguous
    s_ptr,  # [N] fp32 scales of an FP8 W (unused unless HAS_SCALE)
    b_ptr,  # [N] bias (unused unless HAS_BIAS)
    out_ptr,  # [M, N] x's dtype
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rows = tl.minimum(rn, N - 1)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_row = x_ptr + m * stride_xm
    w = tl.load(w_rows + rk[None, :])  # the first step, peeled: [BN, BK]
    if USE_PDL:  # the first W tile is on its way; x comes from the kernel ahead
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = widen(w) * tl.load(x_row + rk).to(tl.float32)[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_rows + (k + rk)[None, :])
        acc += widen(w) * tl.load(x_row + k + rk).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # [BN]
    if HAS_SCALE:
        y *= tl.load(s_ptr + rows)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)
