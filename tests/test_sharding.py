"""Which rows, heads and vocabulary rows each tensor-parallel rank holds (engine/distributed/
sharding.py): exact arithmetic on tiny numbers."""

from __future__ import annotations

import pytest

from engine.distributed.sharding import even_split, head_shard, kv_head_owners, vocab_shard


def test_even_split_covers_the_range_in_order_with_sizes_differing_by_one():
    assert [even_split(10, 3, r) for r in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [even_split(1536, 2, r) for r in range(2)] == [range(0, 768), range(768, 1536)]
    assert [even_split(1, 2, r) for r in range(2)] == [range(0, 1), range(1, 1)]
    with pytest.raises(ValueError, match="rank 2 out of range"):
        even_split(4, 2, 2)


def test_heads_follow_their_kv_group():
    # 4 query heads over 2 KV heads, 2 ranks: one KV head and its two query heads each
    assert head_shard(4, 2, 2, 0).q_heads == range(0, 2)
    assert head_shard(4, 2, 2, 1).kv_heads == range(1, 2)
    assert head_shard(4, 2, 2, 1).q_heads == range(2, 4)
    # SmolLM2-135M: 9 query heads over 3 KV heads, 2 ranks: uneven, by whole groups
    r0, r1 = head_shard(9, 3, 2, 0), head_shard(9, 3, 2, 1)
    assert (r0.kv_heads, r0.q_heads) == (range(0, 2), range(0, 6))
    assert (r1.kv_heads, r1.q_heads) == (range(2, 3), range(6, 9))


def test_fewer_kv_heads_than_ranks_replicates_them():
    assert [head_shard(4, 1, 2, r).kv_heads for r in range(2)] == [range(0, 1)] * 2
    assert [head_shard(4, 1, 2, r).q_heads for r in range(2)] == [range(0, 2), range(2, 4)]
    # 8 query heads, 2 KV heads, 4 ranks: each KV head on two ranks
    assert kv_head_owners(8, 2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [head_shard(8, 2, 4, r).q_heads for r in range(4)] == [
        range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_heads_that_cannot_be_dealt_are_refused():
    with pytest.raises(ValueError, match="must divide the 6 query heads"):
        head_shard(6, 1, 4, 0)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        head_shard(6, 2, 3, 0)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        head_shard(5, 2, 1, 0)


def test_vocab_is_padded_to_equal_shards():
    assert [vocab_shard(10, 4, r) for r in range(4)] == [
        range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert vocab_shard(49152, 2, 1) == range(24576, 49152)
