"""A decode GEMV's activations computed in its prologue instead of by a kernel before it: x's
entries as the GEMV multiplies them, RMSNorm'd (after the residual add) or SwiGLU'd. The W4A16
GEMV (kernels/w4a16_gemv.py) uses them so that a layer's norms and SwiGLU cost no launch.

NOTE: the values and roundings are those of the unfused kernels (kernels/rmsnorm.py,
kernels/silu_mul.py), computed in fp32 and rounded to x's dtype where those round:

    PLAIN          x[k]                    (read as stored: no prologue)
    NORM           s = x,                  round(w[k] * round(s[k] * rstd))
    NORM_RESIDUAL  s = round(x + residual), the same; s is also the new residual stream
    SWIGLU         x = [gate | up] of width 2K: round(silu(gate[k]) * up[k])

    rstd = rsqrt(sum_k s[k]^2 / K + eps)     over the whole row (a few KiB from L2)

A GEMV program needs only its K share of the entries, but each is used by every nibble of
every step: `store_x_entries` computes the share once and stores it (x's dtype, so exactly
the unfused kernel's output) in a [M, K] buffer that the GEMV's loop then reads as it reads a
plain x. Every program of a share computes and stores the same bits; each reads back only
what its own threads wrote, after a barrier. Computing the entries inside the loop instead
(per nibble, per step) doubled the loop's code (the SwiGLU form: 3784 SASS instructions against
1768, sm_90), every [ROWS, 1] slice's exp recomputed by each thread holding it.
"""

from __future__ import annotations

import triton
import triton.language as tl

# x's forms: constexprs, as a Triton kernel may read no other globals
PLAIN, NORM, NORM_RESIDUAL, SWIGLU = (tl.constexpr(form) for form in range(4))
PROLOGUE_BLOCK = 1024  # entries of the row a step of the prologue's loops


@triton.jit
def store_x_entries(x_row, res_row, nw_ptr, s_row, xc_row, k_start, k_stop, K, eps, s_until,
                    FORM: tl.constexpr, BLOCK: tl.constexpr):
    """x's entries k_start .. k_stop of the row, as FORM computes them, stored at xc_row (x's
    dtype); for NORM_RESIDUAL s = round(x + residual) is stored at s_row below `s_until` (K in
    one program, 0 in the others). Ends with a barrier: the program's own stores visible to it."""
    dtype = xc_row.dtype.element_ty
    rstd = 0.0
    if FORM != SWIGLU:
        squares = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            mask = offs < K
            s = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if FORM == NORM_RESIDUAL:
                s += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
                s = s.to(dtype).to(tl.float32)
                tl.store(s_row + offs, s.to(dtype), mask=offs < s_until)
            squares += s * s
        rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    for k in range(k_start, k_stop, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < k_stop
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if FORM == SWIGLU:
            up = tl.load(x_row + K + offs, mask=mask, other=0.0).to(tl.float32)
            x = x / (1.0 + tl.exp(-x)) * up
        else:
            if FORM == NORM_RESIDUAL:
                x = (x + tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
                     ).to(dtype).to(tl.float32)
            normed = (x * rstd).to(dtype).to(tl.float32)
            x = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32) * normed
        tl.store(xc_row + offs, x.to(dtype), mask=mask)
    tl.debug_barrier()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the lines at `ptrs` (any shape) to be brought into L2; nothing is returned and
    no register holds them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
