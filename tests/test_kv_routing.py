"""KV-aware routing: the gateway's block hashes equal the engine's, the prefix cache's events
reach Redis, and the router sends a prompt to the prefill worker holding its prefix unless load
says otherwise."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from engine.block_manager import BlockManager, prefix_hashes
from engine.kv_events import KVEventBatch, KVEvents
from engine.request import Request
from engine.sampling_params import SamplingParams
from gateway.worker_pool import WorkerPool
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.routing import pick_decode, pick_prefill
from pdserve.cluster.state import connect
from pdserve.cluster.worker import PrefixPublisher

BS = 16


def _computed(bm: BlockManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams())
    assert bm.allocate_slots(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(req)
    return req


def test_gateway_hashes_equal_the_engines_and_skip_a_partial_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = _computed(bm, "a", list(range(1000, 1040)))  # 2 full blocks + 8 tokens
    assert prefix_hashes(list(range(1000, 1040)), BS) == req.block_hashes == bm.cached_hashes()
    assert len(prefix_hashes(list(range(47)), BS)) == 2 and prefix_hashes([1] * 15, BS) == []
    assert prefix_hashes(list(range(32)), 32) != prefix_hashes(list(range(32)), 16)[1:]


def test_block_manager_events_follow_registration_and_eviction():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = _computed(bm, "a", list(range(32)))
    first = bm.drain_kv_events()
    assert first.reset and first.stored == a.block_hashes  # a fresh worker starts with a reset
    assert bm.drain_kv_events() == KVEventBatch(False, [], [])
    bm.free(a)
    b = _computed(bm, "b", list(range(500, 564)))  # 4 blocks: evicts both of a's
    batch = bm.drain_kv_events()
    assert (batch.reset, batch.stored, sorted(batch.removed)) == (
        False, b.block_hashes, sorted(a.block_hashes))


def test_events_are_bounded_and_the_last_event_of_a_hash_wins():
    ev = KVEvents(max_pending=3)
    ev.drain([])
    ev.stored(b"a"), ev.removed(b"a"), ev.stored(b"b")
    assert ev.drain([]) == KVEventBatch(False, [b"b"], [b"a"])
    for h in (b"1", b"2", b"3", b"4"):
        ev.stored(h)
    assert ev.drain([b"x", b"y"]) == KVEventBatch(True, [b"x", b"y"], [])


async def test_prefix_index_in_redis(redis_url):
    client = connect(redis_url)
    index = PrefixIndex(client, prefix="kvroute-test", ttl_s=5)
    chain = prefix_hashes(list(range(64)), BS)  # 4 blocks
    await index.publish("p0", KVEventBatch(True, chain[:3]))
    await index.publish("p1", KVEventBatch(True, chain[1:]))
    assert await index.leading_hits(["p0", "p1", "gone"], chain) == {"p0": 3, "p1": 0, "gone": 0}
    await index.publish("p0", KVEventBatch(False, [], [chain[1]]))  # evicted mid-chain
    assert await index.leading_hits(["p0"], chain) == {"p0": 1}
    await index.publish("p0", KVEventBatch(True, []))  # a restarted worker
    assert await index.leading_hits(["p0"], chain) == {"p0": 0}
    assert 0 < await client.pttl("kvroute-test:prefix:p1") <= 5000
    await client.aclose()


async def test_publisher_sends_the_whole_set_after_it_may_have_lapsed(redis_url):
    """A publish later than the index's TTL (the engine answered its events late) sends every
    cached hash, not the events since the last one: those alone, applied to the expired set,
    would lose the blocks cached before."""
    client = connect(redis_url)
    index = PrefixIndex(client, prefix="kvroute-lapse", ttl_s=0.3)
    bm = BlockManager(num_blocks=8, block_size=BS)

    async def events(full: bool) -> KVEventBatch:  # as pdserve.cluster.worker.prefix_events
        batch = bm.drain_kv_events()
        return KVEventBatch(True, bm.cached_hashes()) if full else batch

    publish, info = PrefixPublisher(index, events), _prefill("p0", 0)
    a = _computed(bm, "a", list(range(32)))
    await publish(info)
    b = _computed(bm, "b", list(range(100, 132)))
    await publish(info)  # in time: a diff
    assert await index.leading_hits(["p0"], b.block_hashes) == {"p0": 2}
    await asyncio.sleep(0.4)  # the set expires
    c = _computed(bm, "c", list(range(200, 232)))
    await publish(info)
    for req in (a, b, c):
        assert await index.leading_hits(["p0"], req.block_hashes) == {"p0": 2}
    await client.aclose()


def _prefill(wid: str, queue: int) -> WorkerInfo:
    return WorkerInfo(wid, "prefill", f"127.0.0.1:{len(wid)}{queue}", num_running=queue,
                      num_free_blocks=10, block_size=BS)


def test_score_prefers_the_holder_unless_it_is_the_busiest_for_a_small_prefix():
    p0, p1 = _prefill("p0", 1), _prefill("p1", 0)
    assert pick_prefill([p0, p1]) == p1  # load alone
    assert pick_prefill([p0, p1], {"p0": 9}, 10) == p0  # 0.9 - 1/5 > 0 - 0
    busy = _prefill("p0", 8)
    assert pick_prefill([busy, p1], {"p0": 1}, 10) == p1  # 0.1 - 8/12 < 0: load wins
    assert pick_prefill([busy, p1], {"p0": 10}, 10) == busy  # 1 - 8/12 > 0: recompute costs more
    assert pick_prefill([busy, p1], {"p0": 3, "p1": 4}, 10) == p1


def test_the_gateways_own_calls_in_flight_count_where_the_registry_lags():
    """The registry says both are idle (its heartbeat is older than the last requests); the
    gateway has 8 Prefill calls in flight to the holder: a small prefix no longer pulls the
    next request there, a whole history still does; the registry's larger count wins over a
    smaller in-flight one (other gateways' requests)."""
    p0, p1 = (replace(_prefill(wid, 0), address=f"127.0.0.1:{port}")
              for wid, port in (("p0", 7001), ("p1", 7002)))
    assert pick_prefill([p0, p1], {"p0": 1}, 10) == p0  # 0.1 - 0 > 0
    assert pick_prefill([p0, p1], {"p0": 1}, 10, in_flight={p0.address: 8}) == p1
    assert pick_prefill([p0, p1], {"p0": 10}, 10, in_flight={p0.address: 8}) == p0
    assert pick_prefill([p0, p1], in_flight={p0.address: 1}) == p1  # load alone
    busy = replace(p0, num_running=8)
    assert pick_prefill([busy, p1], {"p0": 1}, 10, in_flight={busy.address: 1}) == p1


def test_ties_go_at_random_and_never_beat_the_load():
    """Idle workers tie on everything: with an rng each request takes one at random (a fixed
    tie-break would send a light load all to one worker); a shorter queue or a hit still wins;
    without an rng, the smaller worker_id."""
    p0, p1, p2 = _prefill("p0", 0), _prefill("p1", 0), _prefill("p2", 0)
    rng = random.Random(0)
    picks = [pick_prefill([p2, p0, p1], rng=rng).worker_id for _ in range(300)]
    assert all(80 < picks.count(w) < 120 for w in ("p0", "p1", "p2")), picks
    assert pick_prefill([p2, p0, p1]) == p0
    busy = _prefill("p1", 1)
    assert {pick_prefill([p0, busy], rng=rng).worker_id for _ in range(20)} == {"p0"}
    assert {pick_prefill([p0, p1], {"p1": 4}, 10, rng=rng).worker_id for _ in range(20)} == {"p1"}
    d0, d1 = _decode("d0", 90), _decode("d1", 90)
    assert {pick_decode([d0, d1], rng=rng).worker_id for _ in range(20)} == {"d0", "d1"}
    assert {pick_decode([d0, _decode("d1", 91)], rng=rng).worker_id for _ in range(20)} == {"d1"}


def _decode(wid: str, free: int) -> WorkerInfo:
    return WorkerInfo(wid, "decode", f"127.0.0.1:{len(wid)}{free}", num_free_blocks=free,
                      num_total_blocks=100, block_size=BS)


def test_decode_score_weighs_a_hit_against_the_caches_fill():
    d0, d1 = _decode("d0", 50), _decode("d1", 90)
    assert pick_decode([d0, d1]) == d1  # load alone: most free blocks
    assert pick_decode([d0, d1], {"d0": 0, "d1": 0}, 10) == d1
    assert pick_decode([d0, d1], {"d0": 10}, 10) == d0  # 0.5 * 1 - 0.5 > 0 - 0.1
    assert pick_decode([d0, d1], {"d0": 5}, 10) == d1  # 0.25 - 0.5 < -0.1
    full = _decode("d0", 20)
    assert pick_decode([full, d1], {"d0": 10}, 10) == d1  # 0.5 - 0.8 < -0.1: too full


async def test_worker_pool_routes_a_second_turn_to_the_holder(redis_url):
    client = connect(redis_url)
    index = PrefixIndex(client, prefix="kvroute-pool", ttl_s=5)
    d0 = WorkerInfo("d0", "decode", "127.0.0.1:9", num_free_blocks=5)
    p0, p1 = _prefill("p0", 0), _prefill("p1", 0)

    class Registry:
        workers = [d0, p0, p1]

        async def list_workers(self, role=None):
            return self.workers

    history = list(range(2000, 2100))
    await index.publish("p1", KVEventBatch(True, prefix_hashes(history, BS)))
    pool = WorkerPool(Registry(), routing="kv_aware", prefixes=index, list_max_age_s=0,
                      list_stale_s=0)
    assert (await pool.route(False, set(), history + [7, 8, 9]))[1] == p1
    assert (await pool.route(False, set(), list(range(50))))[1] in (p0, p1)  # no hits: either
    assert pool.decisions == {"decode:load": 2, "prefill:prefix_hit": 1, "prefill:load": 1}
    # a decode worker holding the history is picked too (it is pushed only the rest)
    d1 = WorkerInfo("d1", "decode", "127.0.0.1:8", num_free_blocks=5, num_total_blocks=10,
                    block_size=BS)
    d0.num_total_blocks, d0.block_size = 10, BS
    await index.publish("d1", KVEventBatch(True, prefix_hashes(history, BS)))
    Registry.workers = [d0, d1, p0, p1]
    assert (await pool.route(False, set(), history + [7]))[0] == d1
    assert pool.decisions["decode:prefix_hit"] == 1
    rr = WorkerPool(Registry(), routing="round_robin")
    picks = [(await rr.route(False, set(), history))[1].worker_id for _ in range(4)]
    assert sorted(picks) == ["p0", "p0", "p1", "p1"]
    by_load = WorkerPool(Registry(), routing="load", rng=random.Random(1))
    picks = [(await by_load.route(False, set(), history))[1].worker_id for _ in range(40)]
    assert 10 < picks.count("p1") < 30  # idle: either, whatever p1 caches
    with pytest.raises(ValueError, match="routing must be one of"):
        WorkerPool(Registry(), routing="random")
    await client.aclose()
