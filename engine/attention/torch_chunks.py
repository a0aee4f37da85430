"""Short chunks over a paged context in one SDPA call (engine/attention/torch_backend.py's path
for speculative verification and small prefill chunks on the CPU).

NOTE: a chunk of a few new tokens continuing a sequence (k drafts + 1 being verified, or the
tail of a chunked prompt) would otherwise run the prefill path alone: per sequence and layer,
two block gathers and an SDPA call with a bool mask. Chunks of at most SHORT_CHUNK tokens are
batched instead, as decodes are: one gather of all their blocks, GQA as query rows, and one
additive mask built once a step:

    q   [T, H, D] -> rows of the chunks, padded to Q = the longest: [S, Q, Hkv, G, D]
                  -> [S, Hkv, Q * G, D]    (row t * G + g: token t, query head g of its kv head)
    k/v [S, Hkv, L, D]                    (L = the most blocks of any chunk x block_size)
    mask[s, 0, t * G + g, j] = 0 where key j <= context_s + t (and t < q_len_s), else -inf

A padded row (t >= q_len_s) may see key 0 only: finite, dropped. Every key a real row sees is in
its sequence's blocks (the cache's masked tail is finite: torch_backend.py's NOTE).

Only a step with two or more such chunks batches them. A lone chunk keeps the per-sequence path,
whose rounding matches a whole prompt's closely enough that a request replayed over its own
cached prefix gives the same greedy tokens (tests/test_cluster.py's streamed-equals-unstreamed
check flipped a near-tie on the bundled model when a lone chunk took this path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_kv_cache import gather_rows

SHORT_CHUNK = 8  # the most new tokens a chunk may have to take this path


def short_seqs(meta: AttentionMetadata) -> tuple[int, ...]:
    """This step's prefill sequences with earlier context and at most SHORT_CHUNK new tokens,
    when there are two or more of them (else none: see the NOTE)."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    seqs = tuple(i for i in range(meta.num_prefills)
                 if (q := starts[i + 1] - starts[i]) <= SHORT_CHUNK and lens[i] > q)
    return seqs if len(seqs) >= 2 else ()


@dataclass(frozen=True)
class ChunkPlan:
    seqs: tuple[int, ...]  # the chunks' sequence indices (prefill positions), in order
    width: int  # Q, the longest chunk
    token_ids: torch.Tensor  # [S * Q] int64: each padded row's token in the packed axis
    block_ids: torch.Tensor  # [S * max_blocks] int64: each chunk's blocks, table padding 0
    sees: torch.Tensor  # [S, 1, Q * G, L] bool, True = attend (the NOTE's mask)


def chunk_plan(meta: AttentionMetadata, seqs: tuple[int, ...], group: int) -> ChunkPlan:
    """The batched plan of `seqs` (`short_seqs`); `group`: query heads per kv head."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    q_lens = [starts[i + 1] - starts[i] for i in seqs]
    width, bs = max(q_lens), meta.block_size
    max_blocks = -(-max(lens[i] for i in seqs) // bs)
    device = meta.block_tables.device
    index = torch.tensor(seqs, device=device)
    block_ids = meta.block_tables[index, :max_blocks].long().reshape(-1)
    t = torch.arange(width, device=device)  # [Q]
    first = torch.tensor([starts[i] for i in seqs], device=device)  # [S]
    real = t[None, :] < torch.tensor(q_lens, device=device)[:, None]  # [S, Q]
    token_ids = torch.where(real, first[:, None] + t[None, :], first[:, None]).reshape(-1)
    context = torch.tensor([lens[i] - q for i, q in zip(seqs, q_lens)], device=device)
    key = torch.arange(max_blocks * bs, device=device)  # [L]
    sees = key[None, None, :] <= (context[:, None] + t[None, :])[:, :, None]  # [S, Q, L]
    sees = torch.where(real[:, :, None], sees, key[None, None, :] == 0)
    sees = sees[:, :, None, :].expand(-1, -1, group, -1).reshape(len(seqs), 1, width * group, -1)
    return ChunkPlan(seqs, width, token_ids, block_ids, sees)


def chunk_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    plan: ChunkPlan,
    rows: torch.Tensor,  # [2 * S * max_blocks] int64: plan.block_ids as K's, then V's rows
    mask: torch.Tensor,  # [S, 1, Q * G, L]: plan.sees as an additive mask in q's dtype
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:  # [S, Q, H, D]: chunk s's token t at [s, t] (rows past its length: padding)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[-2]
    group, s, width = num_heads // num_kv_heads, len(plan.seqs), plan.width
    k_ctx, v_ctx = gather_rows(kv_cache, rows, q.dtype, kv_scales)  # [S * L, Hkv, D]
    ks = k_ctx.view(s, -1, num_kv_heads, head_dim).transpose(1, 2)  # [S, Hkv, L, D]
    vs = v_ctx.view(s, -1, num_kv_heads, head_dim).transpose(1, 2)
    qs = q.index_select(0, plan.token_ids).view(s, width, num_kv_heads, group, head_dim)
    qs = qs.permute(0, 2, 1, 3, 4).reshape(s, num_kv_heads, width * group, head_dim)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
    out = out.view(s, num_kv_heads, width, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(s, width, num_heads, head_dim)
