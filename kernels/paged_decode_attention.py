"""Paged decode attention: one new query token per sequence over its paged KV cache.

NOTE: flash-decoding over a paged cache.

    grid (batch, kv_heads, splits): a program owns one sequence, one KV head and the G = H / Hkv
    query heads that share it (GQA: K/V are read once for the group, the G queries are the rows
    of a [G, D] x [D, BLOCK_N] dot, padded to 16 rows for the tensor cores), and one slice of the
    context. Each sequence's context is cut into `splits` equal runs of BLOCK_N-token tiles, so a
    few long sequences still fill the GPU; short ones leave trailing splits empty.

        tile t:  token n -> page block_table[n // block_size], row n % block_size
                 s = q . k^T * scale  ->  online softmax (running max m, sum l, acc)

    splits == 1: the program normalises and writes the output itself.
    splits > 1 : each split writes acc / l and lse = m + log(l) (fp32); `_reduce_kernel` merges
                 them: out = sum_s exp(lse_s - max lse) * o_s / sum_s exp(lse_s - max lse).

Page ids are widened to int64 before they scale a stride: a large cache overflows int32 offsets.
Sequences of length 0 (padding rows of a CUDA-graph batch) produce zeros.

An fp8 cache (kernels/kv_cache_fp8.py) is read as it is stored, widened to q's dtype in registers
(exact): K's scale folds into the softmax scale, V's into the output (o = acc / l * v_scale), so
the scales cost nothing per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_paged_layout, dot_precision
from kernels.kv_cache_fp8 import check_scales, dequantize_kv

LOG2E = 1.4426950408889634


@triton.jit
def attend_tiles(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq, kv_head, seq_len, tile_lo, tile_hi, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One split's online softmax over tiles [tile_lo, tile_hi) of one sequence and KV head:
    (heads [G], g_mask [G], running max m [G] (base 2), sum l [G], acc [G, D]), all fp32.
    Shared with kernels/paged_decode_attention_merged.py."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g  # [G]
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)  # [G, D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] token positions
        n_mask = offs_n < seq_len
        page = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = page * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh  # [N]
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        k = k.to(q.dtype)  # an fp8 cache widens here (exact); fp32 when UPCAST
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = v.to(q.dtype)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    return heads, g_mask, m_i, l_i, acc


@triton.jit
def store_part(part_ptr, row, o, g_mask, HEAD_DIM: tl.constexpr):
    """One split's partial output o [G, D] at rows `row` [G] of the fp32 workspace
    part [B * H * SPLITS, D]. Shared with kernels/paged_decode_attention_merged.py; each kernel
    stores its lse [G] at the same rows itself, after this (they compute it differently)."""
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])


# Integers that change from step to step are not specialised on (Triton compiles a variant per
# "divisible by 16" / "equal to 1" pattern of its int arguments: a new one mid-serving costs ~1 s).
@triton.jit(do_not_specialize=["num_splits", "stride_tb"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    qk_scale,  # softmax scale * k_scale * log2(e): the kernel works in base 2
    v_scale,  # fp32, an fp8 cache's V scale (1.0 otherwise)
    num_splits,  # a run-time value: a new split count must not cost a compile mid-serving
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,  # K and V caches share strides
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)  # a step's input, written before its first kernel
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    if USE_PDL:  # q and the new K/V come from the kernel ahead (kernels/gemv.py launch_options)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    heads, g_mask, m_i, l_i, acc = attend_tiles(
        q_ptr, k_ptr, v_ptr, tables_ptr, seq, kv_head, seq_len, tile_lo, tile_hi, qk_scale,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
        GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST)
    offs_d = tl.arange(0, HEAD_DIM)
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None] * v_scale  # exact when v_scale is 1
    if ONE_SPLIT:
        out = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # part [B, H, SPLITS, D] and lse [B, H, SPLITS], contiguous fp32
        num_heads = tl.num_programs(1) * GROUP
        row = (seq * num_heads + heads) * num_splits + split  # [G]
        store_part(part_ptr, row, o, g_mask, HEAD_DIM)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))  # base 2
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:  # every part comes from the decode kernel ahead
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))  # [S]
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights 0, output 0
    w = tl.exp2(lse - top)  # [S]
    part = tl.load(part_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)  # [S, D]
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                       block_n: int = 128) -> int:
    """Enough splits for batch * kv_heads * splits programs to cover every SM once, each split
    keeping at least 2 tiles of the longest context (shorter splits cost more in the reduce than
    they add in parallelism), at most 32. Measured on an H100 (132 SMs), bf16, 32/8 heads, d 64:
    B 64 x 1k and B 32 x 8k are fastest with 1 split and 128-token tiles, B 1 x 2k
    with 8 splits."""
    programs = batch * num_kv_heads
    want = triton.cdiv(num_sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, 2 * block_n), 32))


def paged_decode_attention(
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
    pdl: bool = False,  # programmatic dependent launches (Hopper; kernels/gemv.py)
) -> torch.Tensor:  # [B, H, D]
    """Attention of each sequence's one query token over its cached context (already holding
    the token's own K/V). Launches one kernel, plus a reduce when `num_splits` > 1. With `pdl`
    each may start while the kernel ahead finishes: it reads the step's lengths and page
    tables before it waits, q, the cache and the parts after."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_layout(q, k_cache, v_cache)
    check_scales("paged_decode_attention", k_cache.dtype, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if INTERPRET:  # small tiles keep the CPU interpreter's numpy arrays small
        block_n = min(block_n, 16)
    group = num_heads // num_kv_heads
    launch = {"launch_pdl": True} if pdl else {}
    part = lse = out  # unused when one split
    if num_splits > 1:
        part = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, lse,
        scale * k_scale * LOG2E, v_scale, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, ONE_SPLIT=num_splits == 1,
        DOT_PRECISION=dot_precision(q.dtype), UPCAST=INTERPRET, USE_PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )
    if num_splits > 1:
        _reduce_kernel[(batch, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits), USE_PDL=pdl,
            **launch,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:  # [B, H, D], in fp32
    """Reference: gather each sequence's tokens (de-quantized, an fp8 cache) and run plain
    softmax attention in fp32."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        pages = block_tables[b, pos // block_size].long()
        k = dequantize_kv(k_cache[pages, pos % block_size], torch.float32, k_scale)  # [n, Hkv, D]
        v = dequantize_kv(v_cache[pages, pos % block_size], torch.float32, v_scale)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out
