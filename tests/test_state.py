"""pdserve.cluster against a real redis-server: request status machine, TTLs, races,
cancellation, worker registry and heartbeat, routing picks, prefix isolation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.cluster.registry import PRUNE_AFTER_S, Heartbeat, WorkerInfo, WorkerRegistry
from pdserve.cluster.routing import pick_decode, pick_prefill
from pdserve.cluster.state import (
    InvalidTransition,
    Keys,
    RequestExists,
    RequestNotFound,
    RequestStore,
    StateStoreError,
    allowed_transition,
    connect,
    redis_ok,
)
from pdserve.ports import free_port

STATUSES = ["queued", "prefilling", "transferring", "decoding", "finished", "failed", "cancelled"]
# Written out by hand, not derived from the implementation.
ALLOWED = {
    "queued": {"prefilling", "transferring", "decoding", "finished", "failed", "cancelled"},
    "prefilling": {"transferring", "decoding", "finished", "failed", "cancelled"},
    "transferring": {"decoding", "finished", "failed", "cancelled"},
    "decoding": {"finished", "failed", "cancelled"},
    "finished": set(),
    "failed": set(),
    "cancelled": set(),
}
TERMINAL = {"finished", "failed", "cancelled"}


def _expected(src: str, dst: str) -> str:
    if dst in ALLOWED[src]:
        return "ok"
    return "noop" if src == dst and src in TERMINAL else "invalid"


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator:
    c = connect(redis_url)
    await c.flushdb()
    yield c
    await c.aclose()


@pytest.fixture
def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


# ---------------------------------------------------------------- request state


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in STATUSES for d in STATUSES])
async def test_transition_table(client, src: str, dst: str) -> None:
    store = RequestStore(client)
    await store.create("r", model="m", prompt_tokens=3, stream=False)
    if src != "queued":
        await store.transition("r", src)  # queued -> anything else is allowed
    before = await store.get("r")
    assert allowed_transition(src, dst) == (_expected(src, dst) == "ok")

    if _expected(src, dst) == "invalid":
        with pytest.raises(InvalidTransition, match=f"{src} -> {dst}"):
            await store.transition("r", dst, error="x")
        assert await store.get("r") == before
    elif _expected(src, dst) == "noop":
        await store.transition("r", dst, error="x")
        assert await store.get("r") == before
    else:
        await store.transition("r", dst, error="x")
        after = await store.get("r")
        assert after is not None and before is not None
        assert after["status"] == dst and after["error"] == "x"
        assert set(after) - set(before) == {f"ts_{dst}", "error"}
        assert float(after[f"ts_{dst}"]) >= float(before[f"ts_{src}"])


async def test_create_records_fields_timestamps_and_ttl(client) -> None:
    store = RequestStore(client, ttl_s=100)
    t0 = time.time()
    await store.create("r1", model="smol", prompt_tokens=7, stream=True, n=2)
    t1 = time.time()
    state = await store.get("r1")
    assert state is not None
    assert t0 <= float(state["created_at"]) <= t1
    assert state == {"status": "queued", "created_at": state["created_at"],
                     "ts_queued": state["created_at"], "model": "smol", "prompt_tokens": "7",
                     "stream": "1", "n": "2"}
    assert await client.ttl("pdserve:req:r1") in (99, 100)
    with pytest.raises(RequestExists):
        await store.create("r1", model="other", prompt_tokens=1, stream=False)
    assert (await store.get("r1")) == state
    assert await store.get("nope") is None


async def test_transition_records_fields_and_refreshes_ttl(client) -> None:
    store = RequestStore(client, ttl_s=100)
    await store.create("r1", model="m", prompt_tokens=7, stream=False)
    await client.expire("pdserve:req:r1", 5)
    t0 = time.time()
    await store.transition("r1", "prefilling", prefill_worker="p0", decode_worker="d1")
    assert await client.ttl("pdserve:req:r1") in (99, 100)
    await store.transition("r1", "finished", output_tokens=12, finish_reason="stop", error=None)
    state = await store.get("r1")
    assert state is not None
    assert t0 <= float(state["ts_prefilling"]) <= float(state["ts_finished"]) <= time.time()
    assert {k: v for k, v in state.items() if not k.startswith("ts_") and k != "created_at"} == {
        "status": "finished", "model": "m", "prompt_tokens": "7", "stream": "0", "n": "1",
        "prefill_worker": "p0", "decode_worker": "d1", "output_tokens": "12",
        "finish_reason": "stop"}
    assert "ts_transferring" not in state and "ts_decoding" not in state


async def test_a_request_s_writes_wait_for_its_create_in_flight(client) -> None:
    """The gateway does not wait for a request's create: its transitions (and a resume) sent
    before the create landed are written after it, whatever the create did."""
    store = RequestStore(client)
    script = store._create

    async def slow_create(**kw: object) -> object:  # a create whose reply takes its time
        await asyncio.sleep(0.05)
        return await script(**kw)

    store._create = slow_create
    creating = asyncio.ensure_future(store.create("r1", model="m", prompt_tokens=1,
                                                  stream=False))
    moving = asyncio.ensure_future(store.transition("r1", "prefilling"))
    await asyncio.gather(creating, moving)
    assert (await store.get("r1"))["status"] == "prefilling"
    # a create that fails (the id exists) still lets the writes after it go
    again = asyncio.ensure_future(store.create("r1", model="m", prompt_tokens=1, stream=False))
    resumed = asyncio.ensure_future(store.resume("r1"))
    with pytest.raises(RequestExists):
        await again
    assert await resumed == 1
    assert store._creating == {}
    with pytest.raises(RequestNotFound):  # no create in flight: nothing to wait for
        await store.transition("r2", "prefilling")


async def test_transition_rejects_bad_input(client) -> None:
    store = RequestStore(client)
    with pytest.raises(RequestNotFound):
        await store.transition("missing", "failed")
    await store.create("r1", model="m", prompt_tokens=1, stream=False)
    with pytest.raises(ValueError, match="unknown status"):
        await store.transition("r1", "running")
    for field in ("created_at", "ts_finished"):
        with pytest.raises(ValueError, match="reserved"):
            await store.transition("r1", "failed", **{field: 1})
    assert (await store.get("r1"))["status"] == "queued"  # type: ignore[index]


async def test_concurrent_finished_vs_cancelled_leaves_one_terminal(redis_url: str) -> None:
    c1, c2 = connect(redis_url), connect(redis_url)
    a, b = RequestStore(c1, prefix="race"), RequestStore(c2, prefix="race")
    winners = {"finished": 0, "cancelled": 0}
    for i in range(40):
        rid = f"r{i}"
        await a.create(rid, model="m", prompt_tokens=1, stream=True)
        await a.transition(rid, "decoding")
        finish = a.transition(rid, "finished", finish_reason="stop")
        cancel = b.transition(rid, "cancelled", finish_reason="abort")
        first, second = (finish, cancel) if i % 2 else (cancel, finish)  # vary who sends first
        results = await asyncio.gather(first, second, return_exceptions=True)
        results = results if i % 2 else results[::-1]  # back to (finish, cancel)
        assert sum(r is None for r in results) == 1
        assert sum(isinstance(r, InvalidTransition) for r in results) == 1
        winner = "finished" if results[0] is None else "cancelled"
        loser = "cancelled" if winner == "finished" else "finished"
        state = await a.get(rid)
        assert state is not None
        assert state["status"] == winner and f"ts_{winner}" in state
        assert f"ts_{loser}" not in state
        assert state["finish_reason"] == ("stop" if winner == "finished" else "abort")
        winners[winner] += 1
    assert sum(winners.values()) == 40 and min(winners.values()) > 0
    await c1.aclose()
    await c2.aclose()


# ---------------------------------------------------------------- cancellation


async def test_cancel_sets_flag_and_publishes(client) -> None:
    store = RequestStore(client, ttl_s=50)
    assert not await store.is_cancelled("r0")
    await store.cancel("r0")  # nobody listening: the message is lost, the flag is not
    async with store.listen_cancellations() as listener:
        await store.cancel("r1")
        await store.cancel("r2")
        assert await asyncio.wait_for(anext(listener), 2) == "r1"
        assert await asyncio.wait_for(anext(listener), 2) == "r2"
    assert await store.is_cancelled("r0") and await store.is_cancelled("r1")
    assert not await store.is_cancelled("r3")
    assert await client.ttl("pdserve:cancel:r1") in (49, 50)
    assert await client.get("pdserve:cancel:r1") == "1"


# ---------------------------------------------------------------- registry


def _info(worker_id: str, role: str = "decode", **load: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"{worker_id}:50051", **load)


async def test_registry_entry_expires_without_heartbeat(client) -> None:
    reg = WorkerRegistry(client, ttl_s=0.5)
    t0 = time.time()
    stamped = await reg.register(_info("d0", num_free_blocks=11, num_total_blocks=11))
    assert t0 <= stamped.updated_at <= time.time()
    assert await reg.list_workers("decode") == [stamped]
    assert 0 < await client.pttl("pdserve:worker:decode:d0") <= 500
    await asyncio.sleep(0.7)
    assert await reg.list_workers() == []


async def test_heartbeat_keeps_worker_alive_and_deregisters_on_stop(client) -> None:
    reg = WorkerRegistry(client, ttl_s=0.5)
    load = {"num_running": 0}

    async def get_info() -> WorkerInfo:
        load["num_running"] += 1
        return _info("p0", role="prefill", num_running=load["num_running"])

    hb = Heartbeat(reg, get_info, interval_s=0.1)
    hb.start()
    await asyncio.sleep(0.8)  # longer than the TTL: only the heartbeat keeps it listed
    [worker] = await reg.list_workers("prefill")
    assert hb.running and worker.worker_id == "p0" and worker.num_running >= 5
    await hb.stop()
    assert not hb.running
    assert await reg.list_workers() == []  # deregistered at once, not after the TTL


async def test_heartbeat_survives_failures_and_recovers(client) -> None:
    reg = WorkerRegistry(client, ttl_s=0.5)
    calls = {"n": 0}

    async def flaky() -> WorkerInfo:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise ConnectionError("metrics not ready")
        return _info("d0")

    hb = Heartbeat(reg, flaky, interval_s=0.05)
    hb.start()
    await asyncio.sleep(0.4)
    assert hb.running and calls["n"] > 3
    assert [w.worker_id for w in await reg.list_workers()] == ["d0"]
    await hb.stop()


async def test_heartbeat_never_waits_on_a_slow_after_beat(client) -> None:
    """An after_beat that takes 6 TTLs (a busy engine answering its events late) neither stalls
    the beats (the entry stays listed) nor piles up (one runs at a time); stop() cancels it."""
    reg = WorkerRegistry(client, ttl_s=0.4)
    release, calls = asyncio.Event(), []

    async def get_info() -> WorkerInfo:
        return _info("p0", role="prefill")

    async def slow_publish(info: WorkerInfo) -> None:
        calls.append(info.worker_id)
        await release.wait()

    hb = Heartbeat(reg, get_info, interval_s=0.1, after_beat=slow_publish)
    hb.start()
    for _ in range(12):  # 2.4 s
        await asyncio.sleep(0.2)
        assert [w.worker_id for w in await reg.list_workers("prefill")] == ["p0"]
    assert calls == ["p0"]
    release.set()
    await asyncio.sleep(0.35)
    assert len(calls) >= 2  # started again by a beat after the first one ended
    release.clear()
    await asyncio.sleep(0.25)
    running = hb._after
    assert running is not None and not running.done()
    await hb.stop()
    assert running.cancelled() and await reg.list_workers() == []


async def test_heartbeat_survives_redis_down(dead_url: str) -> None:
    dead = connect(dead_url, timeout_s=0.2)
    reg = WorkerRegistry(dead, ttl_s=0.5)
    assert not await redis_ok(dead)
    with pytest.raises(StateStoreError):
        await reg.list_workers()

    async def get_info() -> WorkerInfo:
        return _info("d0")

    hb = Heartbeat(reg, get_info, interval_s=0.05)
    assert await hb.beat() is False
    hb.start()
    await asyncio.sleep(0.3)
    assert hb.running
    await hb.stop()  # deregister fails, is logged, does not raise
    assert not hb.running
    await dead.aclose()


async def test_list_workers_by_role(client) -> None:
    reg = WorkerRegistry(client, ttl_s=5)
    for wid, role in [("t0", "tokenizer"), ("p1", "prefill"), ("p0", "prefill"),
                      ("d0", "decode"), ("g0", "gateway")]:
        await reg.register(_info(wid, role=role))
    await client.set(Keys().worker("decode", "bad"), "not json", px=5000)  # skipped
    assert [w.worker_id for w in await reg.list_workers("prefill")] == ["p0", "p1"]
    assert [w.worker_id for w in await reg.list_workers("decode")] == ["d0"]
    assert [(w.role, w.worker_id) for w in await reg.list_workers()] == [
        ("decode", "d0"), ("gateway", "g0"), ("prefill", "p0"), ("prefill", "p1"),
        ("tokenizer", "t0")]
    await reg.deregister("prefill", "p0")
    assert [w.worker_id for w in await reg.list_workers("prefill")] == ["p1"]
    with pytest.raises(ValueError):
        await reg.list_workers("encoder")
    with pytest.raises(ValueError):
        _info("x", role="encoder")


async def test_listing_reads_the_index_not_the_keyspace(client) -> None:
    """Many other keys cost the listing nothing (it never scans them); an entry that expired
    is not listed though its index member stays until a write prunes it, which drops members
    expired longer than PRUNE_AFTER_S by the writer's clock; deregistering leaves the index."""
    reg = WorkerRegistry(client, ttl_s=5)
    async with client.pipeline(transaction=False) as pipe:
        for i in range(3000):  # requests' state, streams and events
            pipe.set(f"pdserve:request:r{i}", "{}", ex=60)
        await pipe.execute()
    await reg.register(_info("d0"))
    await reg.register(_info("p0", role="prefill"))
    await client.delete(Keys().worker("prefill", "p0"))  # as if its TTL ran out
    listed = []
    real = client.scan_iter
    client.scan_iter = lambda *a, **k: listed.append(a) or real(*a, **k)
    try:
        assert [w.worker_id for w in await reg.list_workers()] == ["d0"]
    finally:
        client.scan_iter = real
    assert listed == []
    index = Keys().worker_index()
    assert await client.zcard(index) == 2
    old = Keys().worker("decode", "gone")
    await client.zadd(index, {old: time.time() - PRUNE_AFTER_S - 1})
    await reg.register(_info("d1"))
    assert set(await client.zrange(index, 0, -1)) == {
        Keys().worker("decode", "d0"), Keys().worker("decode", "d1"),
        Keys().worker("prefill", "p0")}
    await reg.deregister("decode", "d0")
    assert Keys().worker("decode", "d0") not in await client.zrange(index, 0, -1)
    assert [w.worker_id for w in await reg.list_workers("decode")] == ["d1"]


async def test_workers_of_an_earlier_version_are_listed_by_scan_across_pages(client) -> None:
    """No index in the namespace (its workers write none): SCAN finds them."""
    reg = WorkerRegistry(client, ttl_s=5)
    async with client.pipeline(transaction=False) as pipe:
        for i in range(500):
            pipe.set(Keys().worker("decode", f"d{i:03d}"), _info(f"d{i:03d}").to_json(), px=5000)
        await pipe.execute()
    workers = await reg.list_workers("decode")
    assert [w.worker_id for w in workers] == [f"d{i:03d}" for i in range(500)]


async def test_kv_transport_round_trips_and_defaults_to_empty(client) -> None:
    """A worker's --kv-transport survives to_json/from_json and the registry; JSON from a worker
    that predates the field, and a tokenizer's entry, read as ""."""
    info = WorkerInfo("p0", "prefill", "p0:50071", num_free_blocks=11, kv_transport="cuda_ipc")
    assert WorkerInfo.from_json(info.to_json()) == info
    old = '{"worker_id":"d0","role":"decode","address":"d0:50061","num_free_blocks":11}'
    assert WorkerInfo.from_json(old).kv_transport == ""
    assert WorkerInfo("t0", "tokenizer", "t0:50051").kv_transport == ""
    reg = WorkerRegistry(client, ttl_s=5)
    stamped = await reg.register(info)
    await reg.register(WorkerInfo("d0", "decode", "d0:50061", kv_transport="nixl"))
    assert await reg.list_workers("prefill") == [stamped]
    assert [w.kv_transport for w in await reg.list_workers()] == ["nixl", "cuda_ipc"]


# ---------------------------------------------------------------- routing (pure)


def test_pick_decode_most_free_blocks_then_fewest_running() -> None:
    workers = [_info("d0", num_free_blocks=10, num_running=1),
               _info("d1", num_free_blocks=12, num_running=9),
               _info("d2", num_free_blocks=12, num_running=2),
               _info("p0", role="prefill", num_free_blocks=99)]
    assert pick_decode(workers) == workers[2]
    assert pick_decode(workers[:2]) == workers[1]
    d9, d3 = _info("d9"), _info("d3")
    assert pick_decode([d9, d3]) == d3  # full tie: smaller worker_id
    assert pick_decode([]) is None
    assert pick_decode(workers[3:]) is None


def test_pick_prefill_shortest_queue_then_most_free_blocks() -> None:
    workers = [_info("p0", role="prefill", num_waiting=2, num_running=1, num_free_blocks=9),
               _info("p1", role="prefill", num_waiting=0, num_running=3, num_free_blocks=5),
               _info("p2", role="prefill", num_waiting=3, num_running=0, num_free_blocks=11),
               _info("d0", num_waiting=0, num_running=0, num_free_blocks=99)]
    assert pick_prefill(workers) == workers[2]
    assert pick_prefill(workers[:2]) == workers[0]
    p3 = _info("p3", role="prefill", num_waiting=1)
    assert pick_prefill([*workers, p3]) == p3
    assert pick_prefill([]) is None
    assert pick_prefill(workers[3:]) is None


# ---------------------------------------------------------------- isolation, health


async def test_prefixes_isolate_clusters(client) -> None:
    a, b = RequestStore(client, prefix="a"), RequestStore(client, prefix="b")
    await a.create("r1", model="m", prompt_tokens=1, stream=False)
    assert await b.get("r1") is None
    await b.create("r1", model="m", prompt_tokens=1, stream=False)
    await a.transition("r1", "cancelled")
    assert (await b.get("r1"))["status"] == "queued"  # type: ignore[index]

    async with a.listen_cancellations() as la, b.listen_cancellations() as lb:
        await a.cancel("r1")
        assert await asyncio.wait_for(anext(la), 2) == "r1"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(lb), 0.2)
    assert await a.is_cancelled("r1") and not await b.is_cancelled("r1")

    ra, rb = WorkerRegistry(client, prefix="a"), WorkerRegistry(client, prefix="b")
    await ra.register(_info("d0"))
    assert [w.worker_id for w in await ra.list_workers()] == ["d0"]
    assert await rb.list_workers() == []
    for bad in ("", "a:b", "x*", "c[1]"):
        with pytest.raises(ValueError):
            Keys(bad)


async def test_redis_ok(client) -> None:
    assert await redis_ok(client) is True


async def test_more_concurrent_commands_than_connections_wait_for_one(redis_url: str) -> None:
    """A client's pool is bounded; commands beyond it wait for a free connection instead of
    failing (redis-py's default pool raised MaxConnectionsError past 100 under load)."""
    client = connect(redis_url, max_connections=4)
    try:
        async def slow_set(i: int) -> None:  # each holds its connection for a moment
            await client.set(f"pool-test:{i}", str(i))
            await client.blpop([f"pool-test:empty:{i}"], timeout=0.05)

        await asyncio.gather(*(slow_set(i) for i in range(40)))
        assert await client.mget([f"pool-test:{i}" for i in range(40)]) == [
            str(i) for i in range(40)]
        assert client.connection_pool.max_connections == 4
    finally:
        await client.delete(*[f"pool-test:{i}" for i in range(40)])
        await client.aclose()
