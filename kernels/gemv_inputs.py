"""A decode GEMV's activations computed in its prologue instead of read from a kernel before it:
the entries of x as the GEMV multiplies them, for x as stored, RMSNorm'd (after the residual
add) or SwiGLU'd. The W4A16 GEMV (kernels/w4a16_gemv.py) uses them so that a layer's norms and
SwiGLU cost no launch of their own.

NOTE: the values and roundings are those of the unfused kernels (kernels/rmsnorm.py,
kernels/silu_mul.py), computed in fp32 and rounded to x's dtype where those round:

    PLAIN          x[k]
    NORM           s = x,                  round(w[k] * round(s[k] * rstd))
    NORM_RESIDUAL  s = round(x + residual), the same; s is also the new residual stream
    SWIGLU         x = [gate | up] of width 2K: round(silu(gate[k]) * up[k])

    rstd = rsqrt(sum_k s[k]^2 / K + eps)     over the whole row: `row_rstd`, a loop over K
                                             (a few KiB from L2) before the GEMV's own loop

A GEMV program reads only its K share of x but needs the whole row's rstd, so every program
computes it; only one stores s (`store_until`).
"""

from __future__ import annotations

import triton
import triton.language as tl

# x's forms: constexprs, as a Triton kernel may read no other globals
PLAIN, NORM, NORM_RESIDUAL, SWIGLU = (tl.constexpr(form) for form in range(4))
RSTD_BLOCK = 1024  # entries of the row a step of `row_rstd`


@triton.jit
def row_rstd(x_row, res_row, s_row, K, eps, store_until, FORM: tl.constexpr,
             BLOCK: tl.constexpr):
    """rsqrt(mean(s^2) + eps) of the row s (x, or round(x + residual) for NORM_RESIDUAL, which
    is stored at s_row below `store_until`: K in one program, 0 in the others)."""
    dtype = x_row.dtype.element_ty
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < K
        s = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if FORM == NORM_RESIDUAL:
            s += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            s = s.to(dtype).to(tl.float32)
            tl.store(s_row + offs, s.to(dtype), mask=offs < store_until)
        squares += s * s
    return tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def x_entries(x_row, res_row, nw_ptr, offs, rstd, K, FORM: tl.constexpr):
    """x's entries at `offs` (any shape) in fp32, as FORM computes them (see NOTE)."""
    dtype = x_row.dtype.element_ty
    x = tl.load(x_row + offs).to(tl.float32)
    if FORM == SWIGLU:
        up = tl.load(x_row + K + offs).to(tl.float32)
        x = (x / (1.0 + tl.exp(-x)) * up).to(dtype).to(tl.float32)
    elif FORM != PLAIN:
        if FORM == NORM_RESIDUAL:
            x = (x + tl.load(res_row + offs).to(tl.float32)).to(dtype).to(tl.float32)
        normed = (x * rstd).to(dtype).to(tl.float32)
        x = (tl.load(nw_ptr + offs).to(tl.float32) * normed).to(dtype).to(tl.float32)
    return x
