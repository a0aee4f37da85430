"""KV store: write the step's new K/V rows into their paged-cache slots.

NOTE: one program per new token copies its K and V rows (all KV heads, [Hkv * D] elements) to
slot s = page * block_size + row, i.e. element offset s * stride_token of a cache whose blocks are
contiguous ([num_blocks, block_size, Hkv, D]). A negative slot means "no write": the padding
rows of a CUDA-graph batch point there. Slots are int64, so large caches don't overflow.

An fp8 cache (kernels/kv_cache_fp8.py) stores each row as x / scale saturated to +-448, cast to
e4m3 in registers (QUANT); k_scale and v_scale are per-tensor fp32 (1.0 without calibration).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET
from kernels.kv_cache_fp8 import check_scales, is_fp8, quantize_kv

# Triton's interpreter (3.9) casts fp32 to fp8 rounding half up, with no carry into the exponent
# (125.7 -> 64); its casts of values e4m3 holds exactly are right. There the kernels round to
# e4m3 in fp32 first (`_round_to_e4m3`), so the cast is exact; on a GPU the hardware cast rounds.
ROUND_E4M3_IN_FP32: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: e4m3 steps
    by 2**(e - 3) in the binade [2**e, 2**(e+1)) (subnormals: by 2**-9, e clamped to -6); adding
    1.5 * 2**23 steps leaves the sum an ulp of one step, so fp32's own rounding does it."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0  # 1.5 * 2**23
    rounded = (tl.abs(x) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)  # the sign bit: -0.0 stays -0.0


@triton.jit
def _to_cache(x, dst, scale, QUANT: tl.constexpr):
    """x as the cache at `dst` stores it: fp8 of x / scale saturated to e4m3's +-448 (QUANT),
    else x cast to the cache's dtype."""
    if QUANT:
        x = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
        if ROUND_E4M3_IN_FP32:
            x = _round_to_e4m3(x)
    return x.to(dst.dtype.element_ty)


@triton.jit
def _copy_heads(src, dst, num_heads, stride_src_h, stride_dst_h, scale, HEADS_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """Copy one token's rows of `num_heads` heads ([HEAD_DIM] contiguous each) from `src` to
    `dst` (a cache slot), quantized with `scale` when QUANT."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_heads)[:, None]
    rows = tl.load(src + offs_h[:, None] * stride_src_h + offs_d[None, :], mask=mask)
    out = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    tl.store(out, _to_cache(rows, dst, scale, QUANT), mask=mask)


def check_layout(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 *rows: torch.Tensor) -> None:
    """What the store kernels address: cache blocks [block_size, Hkv, D] contiguous and laid
    out alike in K and V (one slot stride for both), each input's head_dim rows contiguous."""
    block_size = k_cache.shape[1]
    if (k_cache.stride(0) != block_size * k_cache.stride(1) or k_cache.stride() != v_cache.stride()
            or any(t.stride(-1) != 1 for t in rows)):
        raise ValueError(f"{op} needs contiguous cache blocks and contiguous head_dim rows")


@triton.jit
def _store_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_t, stride_cache_h,
    k_scale, v_scale,  # fp32, an fp8 cache's per-tensor scales
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    _copy_heads(k_ptr + token * stride_kt, k_cache_ptr + slot * stride_cache_t, NUM_KV_HEADS,
                stride_kh, stride_cache_h, k_scale, HEADS_PAD, HEAD_DIM, QUANT)
    _copy_heads(v_ptr + token * stride_vt, v_cache_ptr + slot * stride_cache_t, NUM_KV_HEADS,
                stride_vh, stride_cache_h, v_scale, HEADS_PAD, HEAD_DIM, QUANT)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D], head_dim contiguous (a view of the fused qkv output is fine)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous blocks
    v_cache: torch.Tensor,  # same dtype: the model's, or fp8 (kernels/kv_cache_fp8.py)
    slot_mapping: torch.Tensor,  # [T] int64; < 0: skip
    k_scale: float = 1.0,  # an fp8 cache's scales (1.0: uncalibrated)
    v_scale: float = 1.0,
) -> None:
    """Mutates k_cache and v_cache."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_layout("store_kv", k_cache, v_cache, k, v)
    check_scales("store_kv", k_cache.dtype, k_scale, v_scale)
    _store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        k_scale, v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), QUANT=is_fp8(k_cache.dtype), num_warps=1,
    )


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Reference: quantize (fp8 caches), scatter through a flat view, skipping negative slots."""
    keep = slot_mapping >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slot_mapping[keep]] = quantize_kv(k[keep], k_cache.dtype, k_scale)
    flat_v[slot_mapping[keep]] = quantize_kv(v[keep], v_cache.dtype, v_scale)
