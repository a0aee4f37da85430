"""Rotary embedding and the KV store in one pass: what kernels/rotary.py and kernels/kv_store.py
do one after the other, in one launch per layer.

NOTE: one program per new token:

    cos|sin of its position ──▶ q heads rotated in place (HF rotate_half, fp32 math, one rounding)
                            ──▶ k heads rotated in registers ─▶ K cache at its slot
    v heads ───────────────────────────────────────────────────▶ V cache at its slot

The rotated k is not written back: attention reads every key from the paged cache. A negative
slot (the padding rows of a CUDA-graph batch) writes no K/V. Against the two kernels it saves a
launch per layer and k's write and re-read, which at batch 1 are most of their time. An fp8 cache
gets the rotated k / k_scale and v / v_scale, saturated and cast in registers (QUANT).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache_fp8 import check_scales, is_fp8
from kernels.kv_store import _copy_heads, _to_cache, check_layout, store_kv_ref
from kernels.rotary import _cos_sin, _rotate, rotary_embedding_ref


@triton.jit
def _rotate_to_cache(src, dst, cos, sin, num_heads, stride_src_h, stride_dst_h, scale,
                     HEADS_PAD: tl.constexpr, HALF: tl.constexpr, QUANT: tl.constexpr):
    """kernels.rotary._rotate of the heads at `src` into a cache slot `dst`, quantized with
    `scale` when QUANT (fp32 math, one rounding)."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    first = src + offs_h[:, None] * stride_src_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    tl.store(out, _to_cache(x1 * cos[None, :] - x2 * sin[None, :], dst, scale, QUANT), mask=mask)
    tl.store(out + HALF, _to_cache(x2 * cos[None, :] + x1 * sin[None, :], dst, scale, QUANT),
             mask=mask)


@triton.jit
def _rope_store_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_t, stride_cache_h, num_heads,
    k_scale, v_scale,  # fp32, an fp8 cache's per-tensor scales
    NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, QUANT: tl.constexpr,  # QUANT: the cache is fp8
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, pos_ptr, token, HALF)
    q = q_ptr + token * stride_qt
    _rotate(q, q, cos, sin, num_heads, stride_qh, stride_qh, Q_HEADS_PAD, HALF)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        _rotate_to_cache(k_ptr + token * stride_kt, k_cache_ptr + slot * stride_cache_t, cos,
                         sin, NUM_KV_HEADS, stride_kh, stride_cache_h, k_scale, K_HEADS_PAD,
                         HALF, QUANT)
        _copy_heads(v_ptr + token * stride_vt, v_cache_ptr + slot * stride_cache_t,
                    NUM_KV_HEADS, stride_vh, stride_cache_h, v_scale, K_HEADS_PAD, 2 * HALF,
                    QUANT)


def rope_and_store(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], read only (its rotation goes to the cache)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous blocks
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; < 0: no K/V write
    cos_sin: torch.Tensor,  # [max_positions, D] fp32 from kernels.rotary.cos_sin_cache
    k_scale: float = 1.0,  # an fp8 cache's scales (1.0: uncalibrated)
    v_scale: float = 1.0,
) -> None:
    """Mutates q, k_cache and v_cache."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    check_layout("rope_and_store", k_cache, v_cache, q, k, v)
    check_scales("rope_and_store", k_cache.dtype, k_scale, v_scale)
    num_kv_heads = k.shape[1]
    _rope_store_kernel[(num_tokens,)](
        positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), num_heads, k_scale, v_scale,
        NUM_KV_HEADS=num_kv_heads, Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2,
        QUANT=is_fp8(k_cache.dtype), num_warps=4,
    )


def rope_and_store_ref(positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin,
                       k_scale=1.0, v_scale=1.0) -> None:
    """Reference: the two kernels' references in turn (q rotated in place, k left as it was)."""
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos_sin)
    q.copy_(q_rot)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
