"""A projection with the residual add and RMSNorm before it in its prologue, for decode steps of
a few tokens: s = x + residual, y [M, N] = rmsnorm(s) @ W [N, K]^T (+ b), K = hidden, M <= 4.

NOTE: grid (cdiv(N, BLOCK_N),). kernels/rmsnorm.py needs the whole row before it can scale
any of it, so it cannot be split along K; but a decode GEMV program reads the whole x row anyway
(K = hidden, a few KiB from L2). So every program loads the full [M, K] rows of x and residual,
computes s, its rstd and the normed, weighted row in registers (the same fp32 math and roundings
as kernels/rmsnorm.py), then dots it with its BLOCK_N rows of W as one [BLOCK_N, K] tile:

    s      = round(x + residual)                                  (program 0 stores it: res_out)
    normed = round(round(s * rsqrt(mean(s^2) + eps)) * norm_w)
    y[m, n] = sum_k normed[m, k] * W[n, k] (* s[n]) (+ b[n])      (s: an FP8 W's row scales)

One launch instead of two, and the normed row never crosses memory. Each program recomputes
the norm (cdiv(N, BLOCK_N) times [M, K] from L2): hence few, wide programs. K must be a power
of two (one tile, no K loop). Without a residual (the first layer), s = x and nothing is stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import (
    GEMV_MAX_TOKENS,
    GemvBlocks,
    block_m_of,
    launch_options,
    scale_arg,
    weight_fits,
)
from kernels.widen import widen


@triton.jit
def add_rmsnorm_rows(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, rm, rows, rk, M, eps, stride_xm, stride_rm, stride_sm,
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """The prologue (shared with kernels/gemv_rmsnorm_swiglu.py): s = x + residual for rows rm
    [BM] (read at `rows` [BM, 1], rm clamped to M - 1; program 0 stores s at res_out), then the
    normed, weighted rows [BM, K], fp32 values rounded to x's dtype as kernels/rmsnorm.py rounds
    them."""
    dtype = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + rows * stride_xm + rk[None, :]).to(tl.float32)  # [BM, K]
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + rows * stride_rm + rk[None, :]).to(tl.float32)
        s = s.to(dtype).to(tl.float32)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + rm.to(tl.int64)[:, None] * stride_sm + rk[None, :],
                     s.to(dtype), mask=rm[:, None] < M)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=1) / K + eps)  # [BM]
    normed = (s * rstd[:, None]).to(dtype).to(tl.float32)
    return (tl.load(nw_ptr + rk).to(tl.float32)[None, :] * normed).to(dtype).to(tl.float32)


@triton.jit
def _gemv_rmsnorm_kernel(
    x_ptr,  # [M, K] the sublayer output (or the embeddings)
    res_ptr,  # [M, K] the residual stream before it (unused unless HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight
    w_ptr,  # [N, K] projection weight, rows contiguous
    s_ptr,  # [N] fp32 scales of an FP8 weight (unused unless HAS_SCALE)
    b_ptr,  # [N] bias (unused unless HAS_BIAS)
    out_ptr,  # [M, N] x's dtype
    res_out_ptr,  # [M, K] x + residual (unused unless HAS_RESIDUAL)
    M,
    N,
    eps,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    stride_sm,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K)
    rows = tl.minimum(rm, M - 1).to(tl.int64)[:, None]  # [BM, 1]
    w = tl.load(w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn + rk[None, :])
    if USE_PDL:  # the weight tile is on its way; x comes from the kernel ahead (launch_options)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = add_rmsnorm_rows(x_ptr, res_ptr, nw_ptr, res_out_ptr, rm, rows, rk, M, eps,
                         stride_xm, stride_rm, stride_sm, K, HAS_RESIDUAL)  # [BM, K]
    y = tl.sum(x[:, None, :] * widen(w)[None, :, :], axis=2)  # [BM, BN]
    if HAS_SCALE:
        y *= tl.load(s_ptr + tl.minimum(rn, N - 1))[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + tl.minimum(rn, N - 1)).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, y.to(dtype), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv_rmsnorm_supports(x: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, weight: torch.Tensor,
                          scale: torch.Tensor | None = None) -> bool:
    """Whether `gemv_rmsnorm` takes these operands (else: rms_norm, then the projection)."""
    k = x.shape[-1]
    same = residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                and residual.dtype == x.dtype)
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_TOKENS and same
            and weight.dim() == 2 and weight.shape[1] == k and norm_weight.shape == (k,)
            and k & (k - 1) == 0 and x.stride(-1) == 1 and weight.stride(-1) == 1
            and norm_weight.is_contiguous() and x.dtype == norm_weight.dtype
            and weight_fits(x.dtype, weight, scale))


def gemv_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, blocks: GemvBlocks | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, N], s [M, K]): the projection of rmsnorm(x + residual) and x + residual (x itself
    when `residual` is None), M <= GEMV_MAX_TOKENS (`gemv_rmsnorm_ref`); an FP8 `weight` with
    its per-row `scale`. Only BLOCK_N and the warps of `blocks` apply (the tile spans K)."""
    if not gemv_rmsnorm_supports(x, residual, norm_weight, weight, scale):
        raise ValueError(
            f"gemv_rmsnorm: x {tuple(x.shape)} {x.dtype}, norm weight "
            f"{tuple(norm_weight.shape)}, weight {tuple(weight.shape)} {weight.dtype}: need "
            f"[M <= {GEMV_MAX_TOKENS}, K] with K a power of two, [K], [N, K] of one dtype "
            f"(or fp8 with [N] fp32 scales)"
        )
    (m, k), n = x.shape, weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv_rmsnorm: bias {tuple(bias.shape)}, expected ({n},)")
    blocks = blocks or GemvBlocks(4, k, 4)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual
    _gemv_rmsnorm_kernel[(triton.cdiv(n, blocks.block_n),)](
        x, res, norm_weight, weight, scale_arg(weight, scale), weight if bias is None else bias,
        out, res_out, m, n, eps,
        x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
        K=k, BLOCK_M=block_m_of(m), BLOCK_N=blocks.block_n, HAS_RESIDUAL=residual is not None,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, USE_PDL=blocks.pdl,
        **launch_options(blocks),
    )
    return out, res_out


def gemv_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/rmsnorm.py's reference, then fp32 products (of the de-quantized weight where
    `scale` is given) rounded once."""
    from kernels.gemv import gemv_ref
    from kernels.rmsnorm import rms_norm_ref

    if residual is None:
        normed, s = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, s = rms_norm_ref(x, norm_weight, eps, residual)
    if scale is not None:
        weight = weight.float() * scale[:, None]
    return gemv_ref(normed, weight, bias), s
