"""Which part of each weight, head and vocabulary row a tensor-parallel rank holds. Torch-free.

Attention heads are dealt by KV group: rank r takes a contiguous run of KV heads and the query
heads that read them, so GQA never needs a KV head from another rank. Runs are as even as they
can be (SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1, with 6 and 3 query heads). With fewer
KV heads than ranks (vLLM's rule) each KV head is replicated on `tp // num_kv_heads` ranks and the
query heads are split evenly:

    num_kv_heads = 4, tp = 2     rank 0: kv [0, 2)  q [0, H/2)      rank 1: kv [2, 4)  q [H/2, H)
    num_kv_heads = 1, tp = 2     rank 0: kv [0, 1)  q [0, H/2)      rank 1: kv [0, 1)  q [H/2, H)

The MLP's intermediate rows and the vocabulary are split in contiguous runs too; the vocabulary
is padded to a multiple of `tp` rows so every rank's lm_head shard has the same height (the
gathered logits are cut back to the real vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass


def even_split(total: int, parts: int, index: int) -> range:
    """The index-th of `parts` contiguous runs covering range(total), sizes differing by <= 1
    (the first `total % parts` runs are one longer)."""
    if not 0 <= index < parts:
        raise ValueError(f"rank {index} out of range for {parts} ranks")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True)
class HeadShard:
    q_heads: range  # query heads of this rank (global indices)
    kv_heads: range  # KV heads of this rank (global indices)


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """The query and KV heads of `rank`; ValueError when the heads cannot be dealt."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp:
        kv = even_split(num_kv_heads, tp, rank)
        return HeadShard(range(kv.start * group, kv.stop * group), kv)
    if tp % num_kv_heads or num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the {num_heads} query heads and be a "
            f"multiple of the {num_kv_heads} KV heads when it exceeds the KV heads"
        )
    q = even_split(num_heads, tp, rank)
    kv_head = rank // (tp // num_kv_heads)
    return HeadShard(q, range(kv_head, kv_head + 1))


def check_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """ValueError unless `tp` ranks can share these heads (checked before any rank starts)."""
    kv_head_owners(num_heads, num_kv_heads, tp)


def kv_head_owners(num_heads: int, num_kv_heads: int, tp: int) -> list[range]:
    """The KV heads of every rank, in rank order (what a KV push from each rank carries)."""
    return [head_shard(num_heads, num_kv_heads, tp, r).kv_heads for r in range(tp)]


def vocab_shard(vocab_size: int, tp: int, rank: int) -> range:
    """Rows of the (padded) vocabulary that `rank` holds; may reach past `vocab_size` on the
    last ranks (padding rows: zero weights, never sampled)."""
    per_rank = -(-vocab_size // tp)
    return range(rank * per_rank, (rank + 1) * per_rank)
