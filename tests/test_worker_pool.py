"""The gateway's worker pool: routing over the registry, and one gRPC channel per worker, closed
once the worker has left the registry (or failed a call with UNAVAILABLE) and no call uses it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.backend import BackendError
from gateway.worker_pool import WorkerPool
from pdserve.cluster.registry import WorkerInfo


class FakeRegistry:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers

    async def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers if role in (None, w.role)]


async def test_worker_pool_closes_the_channels_of_workers_gone() -> None:
    shut = grpc.ChannelConnectivity.SHUTDOWN
    d0 = WorkerInfo("d0", "decode", "127.0.0.1:1")
    p0 = WorkerInfo("p0", "prefill", "127.0.0.1:2")
    registry = FakeRegistry([d0, p0])
    pool = WorkerPool(registry)
    assert await pool.route(local=False, lost=set()) == (d0, p0)
    async with pool.channel(d0.address) as to_d0:
        pass
    async with pool.channel(p0.address) as to_p0:
        registry.workers = [d0]  # p0 left the registry while a call of ours uses it
        assert await pool.list() == [d0]
        assert pool.open_addresses() == {d0.address}
        assert to_p0.get_state() != shut  # the call goes on
    assert to_p0.get_state() == shut  # closed with its last call
    assert to_d0.get_state() != shut
    await pool.retire(d0.address)  # a call failed with UNAVAILABLE
    assert to_d0.get_state() == shut and pool.open_addresses() == set()
    async with pool.channel(d0.address) as fresh:
        assert fresh is not to_d0
    await pool.close()
    assert fresh.get_state() == shut


class DownRegistry:
    async def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        raise ConnectionError("redis down")


async def test_route_avoids_lost_workers_and_says_when_none_is_left() -> None:
    d0 = WorkerInfo("d0", "decode", "127.0.0.1:1", num_free_blocks=9)
    d1 = WorkerInfo("d1", "decode", "127.0.0.1:2", num_free_blocks=5)
    p0 = WorkerInfo("p0", "prefill", "127.0.0.1:3")
    pool = WorkerPool(FakeRegistry([d0, d1, p0]))
    assert await pool.route(local=False, lost=set()) == (d0, p0)
    assert await pool.route(local=False, lost={d0.address}) == (d1, p0)
    assert await pool.route(local=True, lost={p0.address}) == (d0, None)
    with pytest.raises(BackendError, match="no prefill worker"):
        await pool.route(local=False, lost={p0.address})
    with pytest.raises(BackendError, match="no decode worker"):
        await pool.route(local=True, lost={d0.address, d1.address})
    with pytest.raises(BackendError, match="registry unreachable") as failed:
        await WorkerPool(DownRegistry()).list()
    assert failed.value.retryable


class CountingRegistry(FakeRegistry):
    def __init__(self, workers: list[WorkerInfo]) -> None:
        super().__init__(workers)
        self.reads = 0

    async def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        self.reads += 1
        await asyncio.sleep(0.01)  # a Redis round trip
        return await super().list_workers(role)



class Prefixes:
    def __init__(self) -> None:
        self.asked = 0

    async def leading_hits(self, ids: list[str], hashes: list[bytes]) -> dict[str, int]:
        self.asked += 1
        return dict.fromkeys(ids, 0)


async def test_routing_reads_the_registry_in_the_background_and_the_index_only_to_choose(
        ) -> None:
    d0 = WorkerInfo("d0", "decode", "127.0.0.1:1", block_size=4)
    p0 = WorkerInfo("p0", "prefill", "127.0.0.1:2", block_size=4)
    registry, prefixes = CountingRegistry([d0, p0]), Prefixes()
    pool = WorkerPool(registry, prefixes=prefixes, list_max_age_s=0.1, list_stale_s=0.5)
    picks = await asyncio.gather(*(pool.route(False, set(), list(range(40))) for _ in range(8)))
    assert picks == [(d0, p0)] * 8 and registry.reads == 1  # one read, awaited by all eight
    assert prefixes.asked == 0  # one worker of each role: nothing to choose
    assert pool.decisions == {"decode:only": 8, "prefill:only": 8}
    p1 = WorkerInfo("p1", "prefill", "127.0.0.1:3", block_size=4)
    registry.workers = [d0, p0, p1]
    assert await pool.route(False, set(), list(range(40))) == (d0, p0)  # the list held
    assert registry.reads == 1
    await asyncio.sleep(0.15)  # the pool's task read it again meanwhile
    assert registry.reads >= 2
    await pool.route(False, set(), list(range(40)))  # p0 or p1: the index asked
    assert prefixes.asked == 1
    await pool.close()  # its task stops: the list ages
    registry.workers = [d0, p0]  # p1 left
    reads = registry.reads
    assert await pool.route(False, {p0.address}) == (d0, p1)  # from the list held
    assert registry.reads == reads
    with pytest.raises(BackendError, match="no prefill worker"):  # none left in the list
        await pool.route(False, {p0.address, p1.address})         # held: read afresh first
    assert registry.reads == reads + 1
    p2 = WorkerInfo("p2", "prefill", "127.0.0.1:4", block_size=4)
    registry.workers = [d0, p0, p2]  # one just came
    assert await pool.route(False, {p0.address, p1.address}) == (d0, p2)
    assert registry.reads == reads + 2
    await pool.close()
    await asyncio.sleep(0.6)  # past the stale limit: this route waits for a read
    assert await pool.route(False, {p0.address}) == (d0, p2)
    assert registry.reads == reads + 3
    await pool.close()
