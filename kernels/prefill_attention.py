"""Prefill attention: causal attention of a packed batch of new tokens over the paged cache.

NOTE: every key comes from the paged cache, which already holds the new tokens' K/V (the KV store
runs first), so a whole prompt, a chunk continuing a chunked prefill and a prompt after a
prefix-cache hit are the same case: the new tokens of sequence i are the last q_len of its
seq_len tokens, and query t (position p = seq_len - q_len + t) sees keys 0..p.

    grid (query tiles, heads, sequences); a program takes BLOCK_M queries of one head and walks
    the keys in BLOCK_N tiles (flash attention, online softmax in base 2):

        keys [0, full_end)       every key precedes every query of the tile: no mask
        keys [full_end, hi)      the diagonal: mask key > query position
                                 full_end = (first query position) rounded down to BLOCK_N,
                                 hi = last query position + 1

Query tiles run longest-first (the tile index is reversed) so causal imbalance doesn't leave a
long tail. Tiles past a sequence's q_len exit at once.

An fp8 cache (kernels/kv_cache_fp8.py) is widened to q's dtype in registers (exact); K's scale
folds into the softmax scale, V's into the output, as in the decode kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_paged_layout, dot_precision
from kernels.kv_cache_fp8 import check_scales, dequantize_kv

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_base, q_pos, lo, hi, qk_scale,
    stride_kb, stride_kt,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        page = tl.load(table + offs_n // BLOCK_SIZE, mask=offs_n < hi, other=0).to(tl.int64)
        rows = kv_base + page * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt  # [N]
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=(offs_n < hi)[:, None],
                    other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=(offs_n < hi)[:, None],
                    other=0.0)
        k = k.to(q.dtype)  # an fp8 cache widens here (exact); fp32 when UPCAST
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        if MASKED:
            s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_tb"])  # the block-table width changes between steps
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, qstart_ptr, lens_ptr, out_ptr,
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,  # fp32, an fp8 cache's V scale (1.0 otherwise)
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest tiles first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this step's new ones

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context + offs_m  # [M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    kv_base = (head // GROUP) * stride_kh
    first_pos = context + tile * BLOCK_M
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    m_i, l_i, acc = _attend_tile(
        q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_base, q_pos, 0, full_end, qk_scale,
        stride_kb, stride_kt, False, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST,
    )
    m_i, l_i, acc = _attend_tile(
        q, m_i, l_i, acc, k_ptr, v_ptr, table, kv_base, q_pos, full_end, hi, qk_scale,
        stride_kb, stride_kt, True, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale  # exact when v_scale is 1
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def prefill_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of all sequences, packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], new tokens' K already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32, context after this step (earlier + new tokens)
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [T, H, D]
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    k_scale: float = 1.0,  # an fp8 cache's scales (kernels/kv_cache_fp8.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_layout(q, k_cache, v_cache)
    check_scales("prefill_attention", k_cache.dtype, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if INTERPRET:  # small tiles keep the CPU interpreter's numpy arrays small
        block_m, block_n = 16, 16
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), UPCAST=INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D] in fp32
    """Reference: per sequence, gather its whole context (de-quantized, an fp8 cache) and run
    masked softmax in fp32."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        n, q_len = int(seq_lens[i]), end - start
        pos = torch.arange(n, device=q.device)
        pages = block_tables[i, pos // block_size].long()
        k = dequantize_kv(k_cache[pages, pos % block_size], torch.float32, k_scale)
        v = dequantize_kv(v_cache[pages, pos % block_size], torch.float32, v_scale)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[start:end].float(), k) * scale  # [H, q_len, n]
        q_pos = torch.arange(n - q_len, n, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("htn,nhd->thd", scores.softmax(-1), v)
    return out
