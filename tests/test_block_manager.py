"""Block manager: exact block ids, ref counts, prefix-cache hits and eviction order."""

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 16


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def compute_all(bm: BlockManager, req: Request) -> None:
    assert bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def free_order(bm: BlockManager) -> list[int]:
    return list(bm._free)


def refs(bm: BlockManager, ids: list[int]) -> list[int]:
    return [bm.blocks[i].ref_count for i in ids]


def test_allocate_takes_blocks_in_order_and_frees_tail_first():
    bm = BlockManager(num_blocks=11, block_size=BS)
    a = make_req("a", list(range(40)))
    assert bm.allocate_slots(a, 40)
    assert a.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 8
    a.num_computed_tokens = 40
    bm.cache_full_blocks(a)
    assert a.num_registered_blocks == 2  # block 2 holds 8 tokens: not full, not cached
    bm.free(a)
    # unregistered block 2 goes to the front; cached 1 then 0 to the back
    assert free_order(bm) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 0]
    assert a.block_ids == []


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=11, block_size=BS)
    a = make_req("a", list(range(40)))
    compute_all(bm, a)
    b = make_req("b", list(range(32)) + [999] * 8)
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (40, 32)
    assert bm.allocate_slots(b, 8, hits)
    assert b.block_ids == [0, 1, 3]
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 1]
    bm.free(a)
    bm.free(b)
    assert free_order(bm) == [3, 2, 4, 5, 6, 7, 8, 9, 10, 1, 0]
    assert refs(bm, [0, 1, 2, 3]) == [0, 0, 0, 0]


def test_full_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, make_req("a", list(range(48))))
    again = make_req("b", list(range(32)))
    assert bm.get_computed_blocks(again) == [0]  # (32 - 1) // 16 = 1 block at most
    longer = make_req("c", list(range(49)))
    assert bm.get_computed_blocks(longer) == [0, 1, 2]


def test_cached_free_blocks_are_reclaimed_until_evicted():
    bm = BlockManager(num_blocks=11, block_size=BS)
    a = make_req("a", list(range(40)))
    compute_all(bm, a)
    bm.free(a)  # free queue: [2, 3..10, 1, 0]
    big = make_req("big", [7] * (10 * BS))
    assert bm.allocate_slots(big, 10 * BS)
    assert big.block_ids == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1]  # block 1 evicted last-but-one
    c = make_req("c", list(range(40)))
    assert bm.get_computed_blocks(c) == [0]  # block 1's hash is gone; block 0 still cached
    assert bm.blocks[1].block_hash is None


def test_reclaiming_a_cached_block_counts_against_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(33)))
    compute_all(bm, a)  # blocks 0, 1 cached, block 2 partial
    bm.free(a)
    b = make_req("b", list(range(32)) + [5] * 40)  # 72 tokens = 5 blocks
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert not bm.allocate_slots(b, 40, hits)  # needs 3 new + 2 reclaimed > 4 free
    assert b.block_ids == [] and bm.num_free_blocks == 4
    assert refs(bm, [0, 1, 2, 3]) == [0, 0, 0, 0]
    assert bm.allocate_slots(b, 24, hits)  # 56 tokens = 4 blocks fits
    assert b.block_ids == [0, 1, 2, 3]


def test_append_slot_grows_block_table_only_at_block_edge():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(16)))
    compute_all(bm, a)
    assert a.block_ids == [0]
    a.output_token_ids.append(1)  # 17 tokens, 16 computed
    assert bm.allocate_slots(a, 1)
    assert a.block_ids == [0, 1]
    a.num_computed_tokens = 17
    a.output_token_ids.append(2)
    assert bm.allocate_slots(a, 1)
    assert a.block_ids == [0, 1]


def test_duplicate_content_stays_private():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = make_req("a", list(range(17))), make_req("b", list(range(17)))
    assert bm.allocate_slots(a, 17) and bm.allocate_slots(b, 17)  # both before either computes
    for r in (a, b):
        r.num_computed_tokens = 17
        bm.cache_full_blocks(r)
    assert bm.blocks[a.block_ids[0]].block_hash is not None
    assert bm.blocks[b.block_ids[0]].block_hash is None
    bm.free(b)
    assert free_order(bm)[:2] == [2, 3]  # b's blocks hold nothing reusable: front


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    compute_all(bm, make_req("a", list(range(40))))
    assert bm.get_computed_blocks(make_req("b", list(range(40)))) == []
    assert bm.prefix_cache_hits == 0
