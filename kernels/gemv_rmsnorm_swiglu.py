"""The MLP's first half in one launch for decode steps of a few tokens: s = x + residual, then
a [M, I] = silu(rmsnorm(s) @ W_gate^T) * (rmsnorm(s) @ W_up^T), W = [W_gate; W_up] of [2I, K].

NOTE: kernels/gemv_rmsnorm.py (every program norms the whole [M, K] row itself, program 0
stores s; one [BLOCK_N, K] tile per weight, no K loop, K a power of two) with a SwiGLU epilogue:
program p takes gate rows [p*BN, (p+1)*BN) and the up rows I apart from them, so it holds both
halves of its BLOCK_N activations and writes them, not the [M, 2I] projection:

    g = round(normed @ W[j]),  u = round(normed @ W[I + j])     (what gate_up would store)
    a[m, j] = round(silu(g) * u)                                 (kernels/silu_mul.py's math)

The silu_and_mul launch and the [M, 2I] round trip through memory go away; the down projection
then reads `a`. The roundings are those of the three kernels it replaces. An FP8 W's row scales
multiply g and u before they are rounded (kernels/gemv.py).

A tile whose BLOCK_K is shorter than K takes the K-loop kernel instead (kernels/fp8_gemv.py's
shape, the one that streams FP8 gate_up rows fastest on an H200: one token row per program,
short steps along K, products summed once at the end): it norms the whole row first only for
its rstd, then per step re-reads its BLOCK_K slice of s (from L2), norms and weights it as
above, and multiplies it into [BLOCK_N, BLOCK_K] tiles of both halves.
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
from kernels.gemv_rmsnorm import add_rmsnorm_rows
from kernels.widen import widen


@triton.jit
def _gemv_rmsnorm_swiglu_kernel(
    x_ptr,  # [M, K] the attention output
    res_ptr,  # [M, K] the residual stream before it (unused unless HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight
    w_ptr,  # [2I, K] gate rows then up rows, rows contiguous
    s_ptr,  # [2I] fp32 scales of an FP8 weight (unused unless HAS_SCALE)
    out_ptr,  # [M, I] activations, x's dtype
    res_out_ptr,  # [M, K] x + residual (unused unless HAS_RESIDUAL)
    M,
    inter,
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
    USE_PDL: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K)
    rows = tl.minimum(rm, M - 1).to(tl.int64)[:, None]  # [BM, 1]
    gate_rows = w_ptr + tl.minimum(rn, inter - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    w_gate = tl.load(gate_rows + rk[None, :])  # [BN, K]
    w_up = tl.load(gate_rows + inter * stride_wn + rk[None, :])
    if USE_PDL:  # the weight tile is on its way; x comes from the kernel ahead (launch_options)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = add_rmsnorm_rows(x_ptr, res_ptr, nw_ptr, res_out_ptr, rm, rows, rk, M, eps,
                         stride_xm, stride_rm, stride_sm, K, HAS_RESIDUAL)  # [BM, K]
    g = tl.sum(x[:, None, :] * widen(w_gate)[None, :, :], axis=2)  # [BM, BN]
    u = tl.sum(x[:, None, :] * widen(w_up)[None, :, :], axis=2)
    if HAS_SCALE:
        j = tl.minimum(rn, inter - 1)
        g *= tl.load(s_ptr + j)[None, :]
        u *= tl.load(s_ptr + inter + j)[None, :]
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, a.to(dtype), mask=(rm[:, None] < M) & (rn[None, :] < inter))


@triton.jit
def _gemv_rmsnorm_swiglu_kloop_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, out_ptr, res_out_ptr,  # as the kernel above
    M,
    inter,
    eps,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    stride_sm,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (M, I / BLOCK_N): one token row per program, as kernels/fp8_gemv.py."""
    dtype = out_ptr.dtype.element_ty
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + tl.minimum(rn, inter - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    up_rows = gate_rows + inter * stride_wn
    w_gate = tl.load(gate_rows + rb[None, :])  # the first step's tiles, before the wait
    w_up = tl.load(up_rows + rb[None, :])
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rk = tl.arange(0, K)
    s = tl.load(x_ptr + m * stride_xm + rk).to(tl.float32)  # [K]
    if HAS_RESIDUAL:
        s = (s + tl.load(res_ptr + m * stride_rm + rk).to(tl.float32)).to(dtype).to(tl.float32)
        if tl.program_id(1) == 0:
            tl.store(res_out_ptr + m * stride_sm + rk, s.to(dtype))
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / K + eps)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rb
        if k > 0:
            w_gate = tl.load(gate_rows + kk[None, :])
            w_up = tl.load(up_rows + kk[None, :])
        sk = tl.load(x_ptr + m * stride_xm + kk).to(tl.float32)  # [BK]
        if HAS_RESIDUAL:
            sk = (sk + tl.load(res_ptr + m * stride_rm + kk).to(tl.float32)).to(dtype)
            sk = sk.to(tl.float32)
        normed = (sk * rstd).to(dtype).to(tl.float32)
        xk = (tl.load(nw_ptr + kk).to(tl.float32) * normed).to(dtype).to(tl.float32)
        acc_g += widen(w_gate) * xk[None, :]
        acc_u += widen(w_up) * xk[None, :]
    g = tl.sum(acc_g, axis=1)  # [BN]
    u = tl.sum(acc_u, axis=1)
    if HAS_SCALE:
        j = tl.minimum(rn, inter - 1)
        g *= tl.load(s_ptr + j)
        u *= tl.load(s_ptr + inter + j)
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + m * stride_om + rn, a.to(dtype), mask=rn < inter)


def gemv_rmsnorm_swiglu_supports(x: torch.Tensor, residual: torch.Tensor | None,
                                 norm_weight: torch.Tensor, weight: torch.Tensor,
                                 scale: torch.Tensor | None = None) -> bool:
    """Whether `gemv_rmsnorm_swiglu` takes these operands (else: the unfused kernels)."""
    k = x.shape[-1]
    same = residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                and residual.dtype == x.dtype)
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_TOKENS and same
            and weight.dim() == 2 and weight.shape[0] % 2 == 0 and weight.shape[1] == k
            and norm_weight.shape == (k,) and k & (k - 1) == 0 and x.stride(-1) == 1
            and weight.stride(-1) == 1 and norm_weight.is_contiguous()
            and x.dtype == norm_weight.dtype and weight_fits(x.dtype, weight, scale))


def gemv_rmsnorm_swiglu(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, blocks: GemvBlocks | None = None, scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [M, I], s [M, K]): SwiGLU of the gate_up projection of rmsnorm(x + residual), and
    x + residual (x itself when `residual` is None), M <= GEMV_MAX_TOKENS
    (`gemv_rmsnorm_swiglu_ref`); an FP8 `weight` with its per-row `scale`. A `blocks` whose
    BLOCK_K (a power of two) is shorter than K takes the K-loop kernel; else one tile spans K."""
    if not gemv_rmsnorm_swiglu_supports(x, residual, norm_weight, weight, scale):
        raise ValueError(
            f"gemv_rmsnorm_swiglu: x {tuple(x.shape)} {x.dtype}, norm weight "
            f"{tuple(norm_weight.shape)}, weight {tuple(weight.shape)} {weight.dtype}: need "
            f"[M <= {GEMV_MAX_TOKENS}, K] with K a power of two, [K], [2I, K] of one dtype "
            f"(or fp8 with [2I] fp32 scales)"
        )
    (m, k), inter = x.shape, weight.shape[0] // 2
    blocks = blocks or GemvBlocks(2, k, 4)
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual
    kloop = blocks.block_k < k
    if kloop and (blocks.block_k & (blocks.block_k - 1) or blocks.block_k < 16):
        raise ValueError(f"gemv_rmsnorm_swiglu: BLOCK_K {blocks.block_k} is not a power of two "
                         f">= 16")
    args = (x, res, norm_weight, weight, scale_arg(weight, scale), out, res_out, m, inter, eps,
            x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0))
    flags = {"HAS_RESIDUAL": residual is not None, "HAS_SCALE": scale is not None,
             "USE_PDL": blocks.pdl, **launch_options(blocks)}
    if kloop:
        _gemv_rmsnorm_swiglu_kloop_kernel[(m, triton.cdiv(inter, blocks.block_n))](
            *args, K=k, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, **flags)
    else:
        _gemv_rmsnorm_swiglu_kernel[(triton.cdiv(inter, blocks.block_n),)](
            *args, K=k, BLOCK_M=block_m_of(m), BLOCK_N=blocks.block_n, **flags)
    return out, res_out


def gemv_rmsnorm_swiglu_ref(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/gemv_rmsnorm.py's reference, then kernels/silu_mul.py's."""
    from kernels.gemv_rmsnorm import gemv_rmsnorm_ref
    from kernels.silu_mul import silu_and_mul_ref

    gate_up, s = gemv_rmsnorm_ref(x, residual, norm_weight, eps, weight, scale=scale)
    return silu_and_mul_ref(gate_up), s
