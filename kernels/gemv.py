"""Dense GEMV for decode steps of a few tokens: y [M, N] = x [M, K] @ W [N, K]^T (+ b), M <= 4;
W in x's dtype, or FP8 (float8_e4m3fn) with one fp32 scale per output row (engine/quant/fp8.py).

NOTE: grid (cdiv(N, BLOCK_N),). At batch 1 a projection reads every weight once and does two
FLOPs per weight, so what counts is bytes in flight across the whole GPU: many small programs,
each streaming BLOCK_N rows of W in [BLOCK_N, BLOCK_K] tiles (16-byte loads along K), against
all M rows of x at once, so W crosses DRAM once whatever M is. No tensor-core dot (it would pad M
to 16 and cuBLAS's tiles leave SMs idle at N = 2048): a fp32 multiply-add per weight, one
reduction over K at the end.

    acc[m, n, :] += x[m, k:k+BK] * W[n, k:k+BK]      for k in 0, BK, ..., K - BK
                                                     (k = 0 peeled: its W tile is requested
                                                      before a PDL launch waits for x)
    y[m, n] = sum(acc[m, n, :]) (* s[n]) (+ b[n]), rounded once to x's dtype

Rows past N are clamped to N - 1 for the loads (no masks on the weight stream) and dropped at
the store. K must be a multiple of BLOCK_K: the launcher checks it (callers fall back to
F.linear otherwise). Tile sizes are per shape (`GemvBlocks`; engine/models/gemv_plan.py times
them against cuBLAS at load). An FP8 W is half the bytes of a 16-bit one; each weight is widened
to fp32 in registers as it arrives, and its row's scale applied once to the sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.gemv_kloop import _gemv_kloop_kernel
from kernels.widen import widen

GEMV_MAX_TOKENS = 4
FP8 = torch.float8_e4m3fn


class GemvBlocks(NamedTuple):
    """One tile configuration: rows of W per program, K per step, warps per program; `pdl`:
    launched as a programmatic dependent launch (Hopper; see `launch_options`); `kloop`: one
    token row per program in [BLOCK_N, BLOCK_K] steps (kernels/gemv_kloop.py; `gemv` only)."""

    block_n: int
    block_k: int
    num_warps: int
    pdl: bool = False
    kloop: bool = False


def launch_options(blocks: GemvBlocks) -> dict:
    """Launch keywords for `blocks`. With `pdl`, the kernel may start before the one ahead of it
    in the stream has finished: its programs signal at once that the next kernel may launch
    (`gdc_launch_dependents`), and read nothing another kernel writes before `gdc_wait` (which
    returns once the kernel ahead has completed and its writes are visible); weight tiles are
    read before it, overlapping the previous kernel's tail."""
    return {"num_warps": blocks.num_warps, **({"launch_pdl": True} if blocks.pdl else {})}


def default_blocks(n: int, k: int) -> GemvBlocks:
    """Enough programs to fill an H100 (>= ~4 per SM) with 8-16 KiB of W per step."""
    block_k = min(512, k)
    return GemvBlocks(16 if n >= 16384 else 4, block_k, 4)


def block_m_of(m: int) -> int:
    return triton.next_power_of_2(max(m, 1))


def weight_fits(x_dtype: torch.dtype, weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the GEMV kernels take `weight` against activations of `x_dtype`: W of that dtype
    without scales, or FP8 W [N, K] with fp32 scales [N] (x 16-bit or fp32)."""
    if scale is None:
        return weight.dtype == x_dtype
    return (weight.dtype == FP8 and scale.dtype == torch.float32
            and scale.shape == (weight.shape[0],) and scale.is_contiguous())


def scale_arg(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The kernels' scale pointer: the scales, or any tensor where HAS_SCALE is off."""
    return weight if scale is None else scale


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, rows contiguous
    w_ptr,  # [N, K] weight, rows contiguous
    s_ptr,  # [N] fp32 scales of an FP8 W (unused unless HAS_SCALE)
    b_ptr,  # [N] bias (unused unless HAS_BIAS)
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
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w = widen(tl.load(w_rows + rk[None, :]))  # the first step, peeled: [BN, BK]
    if USE_PDL:  # the first W tile is on its way; x comes from the kernel ahead (launch_options)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_rows + rk[None, :]).to(tl.float32)  # [BM, BK]
    acc = x[:, None, :] * w[None, :, :]  # [BM, BN, BK]
    for k in range(BLOCK_K, K, BLOCK_K):
        w = widen(tl.load(w_rows + (k + rk)[None, :]))  # [BN, BK]
        x = tl.load(x_rows + (k + rk)[None, :]).to(tl.float32)  # [BM, BK]
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_SCALE:
        y *= tl.load(s_ptr + tl.minimum(rn, N - 1))[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + tl.minimum(rn, N - 1)).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv_supports(x: torch.Tensor, weight: torch.Tensor, blocks: GemvBlocks,
                  scale: torch.Tensor | None = None) -> bool:
    """Whether `gemv` takes these operands (else: F.linear, or kernels/fp8_gemv.py)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_TOKENS and weight.dim() == 2
            and x.shape[1] == weight.shape[1] > 0 and x.shape[1] % blocks.block_k == 0
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and weight_fits(x.dtype, weight, scale))


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    blocks: GemvBlocks | None = None, scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N] in x's dtype, M <= GEMV_MAX_TOKENS (`gemv_ref`); an
    FP8 `weight` with its per-row `scale` (`kernels/fp8.py` `w8a16_ref`)."""
    blocks = blocks or default_blocks(weight.shape[0], weight.shape[1])
    if not gemv_supports(x, weight, blocks, scale):
        raise ValueError(
            f"gemv: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: need [M <= {GEMV_MAX_TOKENS}, K], [N, K] "
            f"of x's dtype (or fp8 with [N] fp32 scales), contiguous rows, K a multiple of "
            f"{blocks.block_k}"
        )
    (m, k), n = x.shape, weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias {tuple(bias.shape)}, expected ({n},)")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if blocks.kloop:
        _gemv_kloop_kernel[(m, triton.cdiv(n, blocks.block_n))](
            x, weight, scale_arg(weight, scale), weight if bias is None else bias, out, n, k,
            x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None, USE_PDL=blocks.pdl, **launch_options(blocks),
        )
        return out
    _gemv_kernel[(triton.cdiv(n, blocks.block_n),)](
        x, weight, scale_arg(weight, scale), weight if bias is None else bias, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m_of(m), BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, USE_PDL=blocks.pdl,
        **launch_options(blocks),
    )
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
             ) -> torch.Tensor:
    """fp32 products and sums, rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
