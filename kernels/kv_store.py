"""KV store: write the step's new K/V rows into their paged-cache slots.

NOTE: one program per new token copies its K and V rows (all KV heads, [Hkv * D] elements) to
slot s = page * block_size + row, i.e. element offset s * stride_token of a cache whose blocks are
contiguous ([num_blocks, block_size, Hkv, D]). A negative slot means "no write": the padding
rows of a CUDA-graph batch point there. Slots are int64, so large caches don't overflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_heads(src, dst, num_heads, stride_src_h, stride_dst_h, HEADS_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """Copy one token's rows of `num_heads` heads ([HEAD_DIM] contiguous each) from `src` to
    `dst` (a cache slot)."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_heads)[:, None]
    rows = tl.load(src + offs_h[:, None] * stride_src_h + offs_d[None, :], mask=mask)
    tl.store(dst + offs_h[:, None] * stride_dst_h + offs_d[None, :], rows, mask=mask)


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
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    _copy_heads(k_ptr + token * stride_kt, k_cache_ptr + slot * stride_cache_t, NUM_KV_HEADS,
                stride_kh, stride_cache_h, HEADS_PAD, HEAD_DIM)
    _copy_heads(v_ptr + token * stride_vt, v_cache_ptr + slot * stride_cache_t, NUM_KV_HEADS,
                stride_vh, stride_cache_h, HEADS_PAD, HEAD_DIM)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D], head_dim contiguous (a view of the fused qkv output is fine)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous blocks
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; < 0: skip
) -> None:
    """Mutates k_cache and v_cache."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_layout("store_kv", k_cache, v_cache, k, v)
    _store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), num_warps=1,
    )


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Reference: scatter through a flat view, skipping negative slots."""
    keep = slot_mapping >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slot_mapping[keep]] = k[keep]
    flat_v[slot_mapping[keep]] = v[keep]
