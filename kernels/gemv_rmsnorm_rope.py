"""The attention's input side in one launch for decode steps of a few tokens: the residual add
and RMSNorm, the q/k/v projection, the rotary embedding of q and k, and the K/V cache store.

NOTE: kernels/gemv_rmsnorm.py (every program norms the whole [M, K] row itself, program 0
stores s, one [rows, K] weight tile spanning K, K a power of two) with kernels/rope_store.py as
its epilogue. Rotary (HF rotate_half) mixes element j of a head with element j + D/2, so a
program takes rows in pairs: pair p of head h (heads of q, then k, then v, D = 2 * HALF each)

    j = p % HALF:   y1 = row h*D + j,  y2 = row h*D + j + HALF     (both rounded, as qkv stores)
    q head:   out[m, y1|y2 rows] = round(y1 cos - y2 sin), round(y2 cos + y1 sin)
    k head:   K cache[slot[m]] at (h - Hq, j | j + HALF) = the same rotation, cast as it stores
    v head:   V cache[slot[m]] at (h - Hq - Hkv, j | j + HALF) = y1, y2

(cos, sin of position[m], element j: kernels/rotary.py's cache). `out` also keeps k and v as the
projection made them (q rotated, k not: what rope_and_store leaves in the unfused path), and
nothing reads the rotated k but attention, from the cache. A negative slot (a CUDA-graph
batch's padding row) stores no K/V. The rope_store launch and q/k/v's round trip through memory
go away; the roundings are those of the three kernels it replaces (the norm's, the projection's
once, the rotation's once; an fp8 cache's quantization of the rotated value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import GemvBlocks, block_m_of, launch_options, scale_arg
from kernels.gemv_rmsnorm import add_rmsnorm_rows, gemv_rmsnorm_supports
from kernels.kv_cache_fp8 import check_scales, is_fp8
from kernels.kv_store import _to_cache, check_layout
from kernels.widen import widen


@triton.jit
def _gemv_rmsnorm_rope_kernel(
    x_ptr,  # [M, K] the previous layer's output (or the embeddings)
    res_ptr,  # [M, K] the residual stream before it (unused unless HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight
    w_ptr,  # [(Hq + 2 Hkv) D, K] q, k, v rows, rows contiguous
    s_ptr,  # [N] fp32 scales of an FP8 weight (unused unless HAS_SCALE)
    b_ptr,  # [N] bias (unused unless HAS_BIAS)
    out_ptr,  # [M, N] x's dtype: q rotated, k and v as projected
    res_out_ptr,  # [M, K] x + residual (unused unless HAS_RESIDUAL)
    pos_ptr,  # [M] int64 positions
    slots_ptr,  # [M] int64 cache slots (< 0: no K/V store)
    cos_sin_ptr,  # [max_positions, D] fp32: cos | sin halves
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # the same layout
    M,
    eps,
    k_scale,  # fp32, an fp8 cache's per-tensor scales
    v_scale,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    stride_sm,
    stride_cache_t,  # a slot's stride (block_size slots a block, contiguous blocks)
    stride_cache_h,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,  # row pairs a program
    HALF: tl.constexpr,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8
    USE_PDL: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    num_pairs = (Q_HEADS + 2 * KV_HEADS) * HALF
    rm = tl.arange(0, BLOCK_M)
    rp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = rp < num_pairs
    rp = tl.minimum(rp, num_pairs - 1)
    head = rp // HALF
    j = rp % HALF
    r1 = head * (2 * HALF) + j  # [BP] the pair's rows
    r2 = r1 + HALF
    rk = tl.arange(0, K)
    rows = tl.minimum(rm, M - 1).to(tl.int64)[:, None]  # [BM, 1]
    w1 = tl.load(w_ptr + r1.to(tl.int64)[:, None] * stride_wn + rk[None, :])  # [BP, K]
    w2 = tl.load(w_ptr + r2.to(tl.int64)[:, None] * stride_wn + rk[None, :])
    if USE_PDL:  # the weight tiles are on their way; x comes from the kernel ahead
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = add_rmsnorm_rows(x_ptr, res_ptr, nw_ptr, res_out_ptr, rm, rows, rk, M, eps,
                         stride_xm, stride_rm, stride_sm, K, HAS_RESIDUAL)  # [BM, K]
    y1 = tl.sum(x[:, None, :] * widen(w1)[None, :, :], axis=2)  # [BM, BP]
    y2 = tl.sum(x[:, None, :] * widen(w2)[None, :, :], axis=2)
    if HAS_SCALE:
        y1 *= tl.load(s_ptr + r1)[None, :]
        y2 *= tl.load(s_ptr + r2)[None, :]
    if HAS_BIAS:
        y1 += tl.load(b_ptr + r1).to(tl.float32)[None, :]
        y2 += tl.load(b_ptr + r2).to(tl.float32)[None, :]
    y1 = y1.to(dtype).to(tl.float32)  # what the projection would store
    y2 = y2.to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + tl.minimum(rm, M - 1))  # [BM]
    cs = cos_sin_ptr + pos[:, None] * (2 * HALF) + j[None, :]  # [BM, BP]
    cos = tl.load(cs)
    sin = tl.load(cs + HALF)
    rot1 = y1 * cos - y2 * sin
    rot2 = y2 * cos + y1 * sin
    is_q = (head < Q_HEADS)[None, :]
    is_k = ((head >= Q_HEADS) & (head < Q_HEADS + KV_HEADS))[None, :]
    is_v = (head >= Q_HEADS + KV_HEADS)[None, :]
    m_ok = (rm < M)[:, None]
    ok = m_ok & p_ok[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om
    tl.store(out + r1[None, :], tl.where(is_q, rot1, y1).to(dtype), mask=ok)
    tl.store(out + r2[None, :], tl.where(is_q, rot2, y2).to(dtype), mask=ok)
    slot = tl.load(slots_ptr + tl.minimum(rm, M - 1))  # [BM] int64
    stored = ok & (slot >= 0)[:, None]
    kv_head = tl.where(is_k, head[None, :] - Q_HEADS, head[None, :] - Q_HEADS - KV_HEADS)
    cell = slot[:, None] * stride_cache_t + kv_head * stride_cache_h + j[None, :]  # [BM, BP]
    k_at = k_cache_ptr + cell
    tl.store(k_at, _to_cache(rot1, k_at, k_scale, QUANT), mask=stored & is_k)
    tl.store(k_at + HALF, _to_cache(rot2, k_at, k_scale, QUANT), mask=stored & is_k)
    v_at = v_cache_ptr + cell
    tl.store(v_at, _to_cache(y1, v_at, v_scale, QUANT), mask=stored & is_v)
    tl.store(v_at + HALF, _to_cache(y2, v_at, v_scale, QUANT), mask=stored & is_v)


def gemv_rmsnorm_rope_supports(x: torch.Tensor, residual: torch.Tensor | None,
                               norm_weight: torch.Tensor, weight: torch.Tensor,
                               scale: torch.Tensor | None, k_cache: torch.Tensor,
                               num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `gemv_rmsnorm_rope` takes these operands (else: norm + qkv, then rope_and_store):
    what kernels/gemv_rmsnorm.py takes, with W's rows the q, k and v heads of an even head_dim,
    and the cache [num_blocks, block_size, Hkv, D] with contiguous slots."""
    return (gemv_rmsnorm_supports(x, residual, norm_weight, weight, scale)
            and head_dim % 2 == 0 and weight.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim
            and k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim)
            and k_cache.stride(-1) == 1 and k_cache.stride(2) == head_dim)


def gemv_rmsnorm_rope(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None, blocks: GemvBlocks | None,
    scale: torch.Tensor | None, *, num_heads: int, num_kv_heads: int,
    positions: torch.Tensor,  # [M] int64
    cos_sin: torch.Tensor,  # [max_positions, D] fp32 (kernels.rotary.cos_sin_cache)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [M] int64; < 0: no K/V store
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv [M, N] with q rotated, s [M, K] = x + residual): kernels/gemv_rmsnorm.py's
    `gemv_rmsnorm`, then kernels/rope_store.py's `rope_and_store` on its q/k/v (mutates the
    caches), in one launch. `blocks`: BLOCK_N (rows, taken in pairs) and the warps."""
    head_dim = cos_sin.shape[1]
    if not gemv_rmsnorm_rope_supports(x, residual, norm_weight, weight, scale, k_cache,
                                      num_heads, num_kv_heads, head_dim):
        raise ValueError(
            f"gemv_rmsnorm_rope: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}, cache {tuple(k_cache.shape)}, {num_heads} q / {num_kv_heads} kv "
            f"heads of {head_dim}: need what gemv_rmsnorm takes, W of (q + 2 kv heads) x D "
            "rows and a [blocks, block_size, Hkv, D] cache")
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv_rmsnorm_rope: bias {tuple(bias.shape)}, expected ({n},)")
    if positions.shape != (m,) or slot_mapping.shape != (m,):
        raise ValueError(f"gemv_rmsnorm_rope: positions {tuple(positions.shape)} and slots "
                         f"{tuple(slot_mapping.shape)}, expected ({m},)")
    check_layout("gemv_rmsnorm_rope", k_cache, v_cache)
    check_scales("gemv_rmsnorm_rope", k_cache.dtype, k_scale, v_scale)
    blocks = blocks or GemvBlocks(8, k, 4)
    pairs_per_program = max(1, blocks.block_n // 2)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual
    half = head_dim // 2
    _gemv_rmsnorm_rope_kernel[(triton.cdiv(n // 2, pairs_per_program),)](
        x, res, norm_weight, weight, scale_arg(weight, scale), weight if bias is None else bias,
        out, res_out, positions, slot_mapping, cos_sin, k_cache, v_cache, m, eps, k_scale,
        v_scale, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        K=k, BLOCK_M=block_m_of(m), BLOCK_P=pairs_per_program, HALF=half,
        Q_HEADS=num_heads, KV_HEADS=num_kv_heads, HAS_RESIDUAL=residual is not None,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, QUANT=is_fp8(k_cache.dtype),
        USE_PDL=blocks.pdl, **launch_options(blocks),
    )
    return out, res_out


def gemv_rmsnorm_rope_ref(
    x, residual, norm_weight, eps, weight, bias, scale, *, num_heads, num_kv_heads, positions,
    cos_sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: kernels/gemv_rmsnorm.py's, then kernels/rope_store.py's on its q/k/v
    (mutates the caches)."""
    from kernels.gemv_rmsnorm import gemv_rmsnorm_ref
    from kernels.rope_store import rope_and_store_ref

    qkv, s = gemv_rmsnorm_ref(x, residual, norm_weight, eps, weight, bias, scale)
    head_dim, m = cos_sin.shape[1], x.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(m, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(m, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(m, num_kv_heads, head_dim)
    rope_and_store_ref(positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin,
                       k_scale, v_scale)
    return qkv, s
