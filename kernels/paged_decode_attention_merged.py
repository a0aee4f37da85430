"""Paged decode attention in one launch: the splits of a sequence merge inside the kernel.

NOTE: the same flash-decoding programs as kernels/paged_decode_attention.py (grid (batch,
kv_heads, splits), the tile loop `attend_tiles` shared with it), without its second kernel.

    per sequence: tiles = cdiv(len, BLOCK_N), per split = cdiv(tiles, splits),
                  used  = cdiv(tiles, per split)  (<= splits; 1 for a length of 0)

    split >= used : nothing (a short sequence in a graph sized for max_model_len).
    used == 1     : split 0 normalises and writes the output itself: no workspace, no ticket.
    used > 1      : each split stores acc / l and lse = m + log2(l) (fp32), then takes a ticket
                    of its (sequence, kv head); the one that draws `used - 1` arrived last, so
                    every part is stored: it merges them (out = sum_s 2^(lse_s - M) o_s /
                    sum_s 2^(lse_s - M), M their max; all parts of the group in one load)
                    and sets the ticket back to 0.

CUDA-graph safe: the grid is (batch, kv_heads, splits), from shapes and the split count fixed at
capture; `used` is read from seq_lens on the device; the tickets (kernels/w4a16.py's per-device
counters, zeroed once) are left 0 by the kernel itself. An fp8 cache is de-quantized as in the
two-kernel path (k_scale in the softmax scale, v_scale on each split's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_paged_layout, dot_precision
from kernels.kv_cache_fp8 import check_scales
from kernels.paged_decode_attention import LOG2E, attend_tiles, store_part
from kernels.w4a16 import tickets


@triton.jit(do_not_specialize=["num_splits", "stride_tb"])
def _decode_merged_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D], K's strides
    tables_ptr,  # [B, max_blocks] int32
    lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D]
    part_ptr,  # [B, H, SPLITS, D] fp32 workspace, contiguous
    lse_ptr,  # [B, H, SPLITS] fp32 workspace (base-2 log-sum-exp), contiguous
    ticket_ptr,  # [>= B * Hkv] int32 arrival counters, 0 before and after
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,  # fp32, an fp8 cache's V scale (1.0 otherwise)
    num_splits,  # the grid's third size
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_P2: tl.constexpr, SPLITS_PAD: tl.constexpr,  # next powers of 2 of GROUP, the splits
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), 1)
    used = tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)
    if split < used:
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
        heads, g_mask, m_i, l_i, acc = attend_tiles(
            q_ptr, k_ptr, v_ptr, tables_ptr, seq, kv_head, seq_len, tile_lo, tile_hi, qk_scale,
            stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
            GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST)
        offs_d = tl.arange(0, HEAD_DIM)
        out = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]  # [G, D]
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None] * v_scale  # exact when v_scale is 1
        if used == 1:
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            rows_base = seq * tl.num_programs(1) * GROUP * num_splits  # the sequence's rows
            rows = rows_base + heads * num_splits  # [G], split 0's row of each head
            store_part(part_ptr, rows + split, o, g_mask, HEAD_DIM)
            # every split of a used run has >= 1 token: l > 0
            tl.store(lse_ptr + rows + split, m_i + tl.log2(safe_l), mask=g_mask)
            tl.debug_barrier()  # every thread's stores before the ticket (release) is taken
            ticket = ticket_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == used - 1:
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # for the next call
                merged = _merge_parts(part_ptr, lse_ptr, rows_base, used, num_splits, kv_head,
                                      GROUP, GROUP_P2, SPLITS_PAD, HEAD_DIM)  # [G2, D]
                offs_h = kv_head * GROUP + tl.arange(0, GROUP_P2)
                tl.store(out_ptr + seq * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                         merged.to(out_ptr.dtype.element_ty),
                         mask=(tl.arange(0, GROUP_P2) < GROUP)[:, None])


@triton.jit
def _merge_parts(part_ptr, lse_ptr, rows_base, used, num_splits, kv_head,
                 GROUP: tl.constexpr, GROUP_P2: tl.constexpr, SPLITS_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """All parts of the group's heads in one [GROUP_P2 * SPLITS_PAD, D] load (one round trip to
    L2, not one per split), weighted by 2^(lse - max) and summed over the splits: [GROUP_P2, D].

        row r -> head g = r // SPLITS_PAD, split s = r % SPLITS_PAD
    """
    offs_r = tl.arange(0, GROUP_P2 * SPLITS_PAD)
    g = offs_r // SPLITS_PAD
    r_mask = (g < GROUP) & (offs_r % SPLITS_PAD < used)
    prow = rows_base + (kv_head * GROUP + g) * num_splits + offs_r % SPLITS_PAD  # [R]
    lse = tl.load(lse_ptr + prow, mask=r_mask, other=float("-inf"), cache_modifier=".cg")
    lse = tl.reshape(lse, [GROUP_P2, SPLITS_PAD])
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # padding heads: weights 0
    w = tl.exp2(lse - top[:, None])  # [G2, S]
    total = tl.sum(w, 1)
    offs_d = tl.arange(0, HEAD_DIM)
    part = tl.load(part_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=r_mask[:, None],
                   other=0.0, cache_modifier=".cg")  # [R, D]
    part = tl.reshape(part, [GROUP_P2, SPLITS_PAD, HEAD_DIM])
    merged = tl.sum(part * w[:, :, None], 1)
    return merged / tl.where(total > 0, total, 1.0)[:, None]


def paged_decode_attention_merged(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], same strides as k_cache
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache per sequence
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,  # [B, H, D]
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: float = 1.0,  # an fp8 cache's scales (kernels/kv_cache_fp8.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, H, D]
    """`kernels.paged_decode_attention.paged_decode_attention` (same arguments, same result up
    to fp32 rounding) in one launch for any `num_splits`."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_paged_layout(q, k_cache, v_cache)
    check_scales("paged_decode_attention_merged", k_cache.dtype, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if INTERPRET:  # small tiles keep the CPU interpreter's numpy arrays small
        block_n = min(block_n, 16)
    group = num_heads // num_kv_heads
    # allocated even for one split (then unused): the same pointer types, one compiled variant
    part = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                       device=q.device)
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    counters = tickets(q.device, batch * num_kv_heads)
    _decode_merged_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, lse, counters,
        scale * k_scale * LOG2E, v_scale, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        GROUP_P2=triton.next_power_of_2(group), SPLITS_PAD=triton.next_power_of_2(num_splits),
        DOT_PRECISION=dot_precision(q.dtype), UPCAST=INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
