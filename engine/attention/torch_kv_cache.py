"""The paged KV cache read and written in pure torch (engine/attention/torch_backend.py's cache
side): scatter new tokens' K/V into their slots, gather whole blocks back.

    kv_cache [2, num_blocks, block_size, Hkv, D]: K then V; slot = block * block_size + offset

Rows move as bytes (`as_bytes`: torch has no CPU index_copy_ for fp8) on 2-D views, far cheaper
on a CPU than indexing the 5-D cache. An fp8 cache (kernels/kv_cache_fp8.py) stores k / k_scale
and v / v_scale saturated to e4m3; gathers de-quantize (fp32 x scale, then the asked dtype).
"""

from __future__ import annotations

import torch

from kernels.kv_cache_fp8 import as_bytes, dequantize_kv, quantize_kv


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter the new tokens' K/V into their cache slots, quantized for an fp8 cache (mutates
    `kv_cache`)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = as_bytes(kv_cache).view(2, -1, num_kv_heads, head_dim)  # [2, blocks * bs, Hkv, D]
    if k.dtype != kv_cache.dtype:
        k = as_bytes(quantize_kv(k, kv_cache.dtype, k_scale))
        v = as_bytes(quantize_kv(v, kv_cache.dtype, v_scale))
    k_flat, v_flat = flat.unbind(0)
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


def gather_rows(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    rows: torch.Tensor,  # [2 * N] int64: N blocks' rows of K, then the same of V
    dtype: torch.dtype,
    kv_scales: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V: [N * block_size, Hkv, D] each, copies
    """`gather_blocks` of N blocks in one index_select over the cache viewed
    [2 * num_blocks, ...]: K's rows are block ids, V's are block ids + num_blocks."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = as_bytes(kv_cache).view(2 * kv_cache.shape[1], -1)  # [2 * num_blocks, bs * Hkv * D]
    k, v = flat.index_select(0, rows).view(kv_cache.dtype).chunk(2)
    if dtype != kv_cache.dtype:
        k, v = dequantize_kv(k, dtype, kv_scales[0]), dequantize_kv(v, dtype, kv_scales[1])
    return k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


def gather_blocks(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_ids: torch.Tensor,  # [N] int64
    dtype: torch.dtype | None = None,  # what to read them as (None: the cache's dtype)
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V: [N * block_size, Hkv, D] each, copies
    """K and V of the listed blocks, concatenated in order, de-quantized to `dtype` when the
    cache is fp8. (Row gathers on 2-D views are much faster on CPU than one index_select over
    dim 1 of the 5-D cache.)"""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    rows = (num_blocks, block_size * num_kv_heads * head_dim)
    k = as_bytes(kv_cache[0]).view(rows).index_select(0, block_ids)  # [N, bs * Hkv * D]
    v = as_bytes(kv_cache[1]).view(rows).index_select(0, block_ids)
    k, v = k.view(kv_cache.dtype), v.view(kv_cache.dtype)
    if dtype is not None and dtype != kv_cache.dtype:
        k, v = dequantize_kv(k, dtype, kv_scales[0]), dequantize_kv(v, dtype, kv_scales[1])
    return k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
