"""The MLP's down projection with SwiGLU in its prologue, for decode steps of a few tokens:
y [M, N] = (silu(gate) * up) @ W [N, I]^T, gate_up = [gate | up] of shape [M, 2I], M <= 4.

NOTE: kernels/gemv.py's GEMV (grid (cdiv(N, BLOCK_N),), BLOCK_N rows of W per program, fp32
multiply-adds, one reduction at the end), except that x is not read from memory: each program
computes it per K chunk from the gate_up projection's output,

    a[m, k:k+BK] = round(silu(gate[m, k:k+BK]) * up[m, k:k+BK])       (fp32, rounded to the dtype)
    acc[m, n, :] += a[m, k:k+BK] * W[n, k:k+BK]

so the [M, I] activation never crosses memory and one launch replaces two. Every program
recomputes the same activations (cdiv(N, BLOCK_N) times [M, I] silus, read from L2): cheap next
to streaming W at M <= 4. Rounding `a` to the dtype first makes the result that of
kernels/silu_mul.py followed by kernels/gemv.py. W may be FP8 with per-row scales, as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import (
    GEMV_MAX_TOKENS,
    GemvBlocks,
    block_m_of,
    default_blocks,
    launch_options,
    scale_arg,
    weight_fits,
)
from kernels.widen import widen


@triton.jit
def _gemv_silu_kernel(
    gu_ptr,  # [M, 2I] gate_up projection output: gate in columns [0, I), up in [I, 2I)
    w_ptr,  # [N, I] down projection weight, rows contiguous
    s_ptr,  # [N] fp32 scales of an FP8 weight (unused unless HAS_SCALE)
    out_ptr,  # [M, N] gate_up's dtype
    M,
    N,
    inter,
    stride_gm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see kernels/gemv.py launch_options
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    g_rows = gu_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_gm  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        w = widen(tl.load(w_rows + (k + rk)[None, :]))  # [BN, BK]
        gate = tl.load(g_rows + (k + rk)[None, :]).to(tl.float32)  # [BM, BK]
        up = tl.load(g_rows + inter + (k + rk)[None, :]).to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += a[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_SCALE:
        y *= tl.load(s_ptr + tl.minimum(rn, N - 1))[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv_silu_supports(gate_up: torch.Tensor, weight: torch.Tensor, blocks: GemvBlocks,
                       scale: torch.Tensor | None = None) -> bool:
    """Whether `gemv_silu` takes these operands (else: silu_and_mul, then the projection)."""
    return (gate_up.dim() == 2 and 0 < gate_up.shape[0] <= GEMV_MAX_TOKENS
            and weight.dim() == 2 and gate_up.shape[1] == 2 * weight.shape[1]
            and weight.shape[1] % blocks.block_k == 0 and gate_up.stride(-1) == 1
            and weight.stride(-1) == 1 and weight_fits(gate_up.dtype, weight, scale))


def gemv_silu(
    gate_up: torch.Tensor, weight: torch.Tensor, blocks: GemvBlocks | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, 2I] gate_up x [N, I] -> [M, N]: down(silu(gate) * up), M <= GEMV_MAX_TOKENS
    (`gemv_silu_ref`); an FP8 `weight` with its per-row `scale` (kernels/gemv.py)."""
    blocks = blocks or default_blocks(weight.shape[0], weight.shape[1])
    if not gemv_silu_supports(gate_up, weight, blocks, scale):
        raise ValueError(
            f"gemv_silu: gate_up {tuple(gate_up.shape)} {gate_up.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: need [M <= {GEMV_MAX_TOKENS}, 2I], [N, I] "
            f"of gate_up's dtype (or fp8 with [N] fp32 scales), contiguous rows, I a multiple "
            f"of {blocks.block_k}"
        )
    m, (n, inter) = gate_up.shape[0], weight.shape
    out = torch.empty(m, n, dtype=gate_up.dtype, device=gate_up.device)
    _gemv_silu_kernel[(triton.cdiv(n, blocks.block_n),)](
        gate_up, weight, scale_arg(weight, scale), out, m, n, inter,
        gate_up.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m_of(m), BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        HAS_SCALE=scale is not None, USE_PDL=blocks.pdl, **launch_options(blocks),
    )
    return out


def gemv_silu_ref(gate_up: torch.Tensor, weight: torch.Tensor,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up rounded to the dtype (as kernels/silu_mul.py), then fp32 products (of
    the de-quantized weight where `scale` is given)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    a = (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
    w = weight.float() if scale is None else weight.float() * scale[:, None]
    return (a.float() @ w.t()).to(gate_up.dtype)
