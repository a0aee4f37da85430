"""prefill_svc/write_batches.py: the data-plane writes that pushes towards one decode worker ask
for in one event-loop turn go as one write (a recording plane stands in for cuda_ipc / nixl,
which the transfer tests run for real)."""

from __future__ import annotations

import asyncio

import pytest

from engine.kv_progress import KVWatch
from pdserve.cluster.worker import TransferStats
from pdserve.transport.base import Peer, PoolInfo
from prefill_svc import write_batches
from prefill_svc.push import SlabTicket
from prefill_svc.write_batches import WriteBatches

CELL = 100  # bytes of one block of one layer


class RecordingPlane:
    name = "recording"

    def __init__(self, fail: bool = False) -> None:
        self.writes: list[tuple[tuple[int, int], list[int], list[int], list]] = []
        self.fail = fail
        self.watch_of: dict[int, KVWatch] = {}  # by source block

    def write(self, peer, layers, src_ids, dst_ids, ready=None) -> int:
        # every ticket's reading() is held while its blocks are read: no preemption meanwhile
        assert all(self.watch_of[b]._lock.locked() for b in src_ids)
        if self.fail:
            raise ConnectionError("peer gone")
        self.writes.append((layers, list(src_ids), list(dst_ids), ready))
        return len(src_ids) * (layers[1] - layers[0]) * CELL


def _peer(pool_id: str = "pool-a") -> Peer:
    return Peer(PoolInfo(pool_id, "host", None, 64, "cuda", ("cuda_ipc", "grpc")), "cuda_ipc")


def _ticket(plane: RecordingPlane, blocks: tuple[int, ...], ready: object = None,
            layers: tuple[int, int] = (0, 4), stale: bool = False) -> SlabTicket:
    watch = KVWatch(lambda note: None)
    plane.watch_of.update(dict.fromkeys(blocks, watch))
    ticket = SlabTicket((*layers, 0, len(blocks)), blocks, 0, ready, watch)
    if stale:
        watch.invalidate()  # a preemption after the note: its blocks may be another's
    return ticket


def test_writes_asked_together_go_as_one_after_each_distinct_event() -> None:
    async def run() -> None:
        plane, stats, peer = RecordingPlane(), TransferStats(), _peer()
        batches = WriteBatches(CELL, stats)
        step_end, other = object(), object()
        asked = [(_ticket(plane, (1, 2), step_end), [10, 11]),
                 (_ticket(plane, (3,), step_end), [12]),
                 (_ticket(plane, (4, 5, 6), other), [20, 21, 22])]
        results = await asyncio.gather(*(batches.write(plane, peer, t, d) for t, d in asked))
        assert [r[0] for r in results] == [2 * 4 * CELL, 4 * CELL, 3 * 4 * CELL]
        assert len(plane.writes) == 1 and stats.plane_writes == 1
        layers, src, dst, ready = plane.writes[0]
        assert (layers, src, dst) == ((0, 4), [1, 2, 3, 4, 5, 6], [10, 11, 12, 20, 21, 22])
        assert ready == [step_end, other]

    asyncio.run(run())


def test_stale_tickets_are_left_out_and_layer_ranges_write_apart() -> None:
    async def run() -> None:
        plane, stats, peer = RecordingPlane(), TransferStats(), _peer()
        batches = WriteBatches(CELL, stats)
        results = await asyncio.gather(
            batches.write(plane, peer, _ticket(plane, (1,)), [10]),
            batches.write(plane, peer, _ticket(plane, (2,), stale=True), [11]),
            batches.write(plane, peer, _ticket(plane, (3,), layers=(0, 2)), [12]),
            batches.write(plane, peer, _ticket(plane, (4,)), [13]))
        assert [r[0] for r in results] == [4 * CELL, None, 2 * CELL, 4 * CELL]
        assert sorted((w[0], w[1], w[2]) for w in plane.writes) == [
            ((0, 2), [3], [12]), ((0, 4), [1, 4], [10, 13])]
        assert stats.plane_writes == 2

    asyncio.run(run())


def test_peers_and_loop_turns_get_writes_of_their_own() -> None:
    async def run() -> None:
        plane, stats = RecordingPlane(), TransferStats()
        batches = WriteBatches(CELL, stats)
        await asyncio.gather(batches.write(plane, _peer("a"), _ticket(plane, (1,)), [10]),
                             batches.write(plane, _peer("b"), _ticket(plane, (2,)), [11]))
        await batches.write(plane, _peer("a"), _ticket(plane, (3,)), [12])
        assert sorted(w[1] for w in plane.writes) == [[1], [2], [3]]

    asyncio.run(run())


def test_a_failed_write_fails_every_push_in_it_and_a_cancelled_one_is_left_out() -> None:
    async def run() -> None:
        plane, peer = RecordingPlane(fail=True), _peer()
        batches = WriteBatches(CELL, TransferStats())
        first = asyncio.ensure_future(batches.write(plane, peer, _ticket(plane, (1,)), [10]))
        second = asyncio.ensure_future(batches.write(plane, peer, _ticket(plane, (2,)), [11]))
        await asyncio.sleep(0)  # both asked in this turn
        second.cancel()
        with pytest.raises(ConnectionError, match="peer gone"):
            await first
        assert second.cancelled()

        plane.fail = False
        gone = asyncio.ensure_future(batches.write(plane, peer, _ticket(plane, (3,)), [12]))
        await asyncio.sleep(0)
        gone.cancel()  # before its turn came: never written
        assert (await batches.write(plane, peer, _ticket(plane, (4,)), [13]))[0] == 4 * CELL
        assert [w[1] for w in plane.writes] == [[4]]

    asyncio.run(run())


def test_each_slab_alone_when_batches_are_off(monkeypatch) -> None:
    monkeypatch.setattr(write_batches, "BATCHES", False)

    async def run() -> None:
        plane, stats, peer = RecordingPlane(), TransferStats(), _peer()
        batches = WriteBatches(CELL, stats)
        ready = object()
        results = await asyncio.gather(
            batches.write(plane, peer, _ticket(plane, (1,), ready), [10]),
            batches.write(plane, peer, _ticket(plane, (2,), stale=True), [11]))
        assert [r[0] for r in results] == [4 * CELL, None]
        assert [(w[1], w[3]) for w in plane.writes] == [([1], ready)] and stats.plane_writes == 1

    asyncio.run(run())


def test_two_tickets_of_one_request_go_in_writes_of_their_own() -> None:
    """One request's reading() is one lock: a write holding two of its tickets would wait on
    itself for ever."""

    async def run() -> None:
        plane, stats, peer = RecordingPlane(), TransferStats(), _peer()
        batches = WriteBatches(CELL, stats)
        first = _ticket(plane, (1,))
        second = SlabTicket((0, 4, 1, 2), (2,), 0, None, first.watch)
        plane.watch_of[2] = first.watch
        results = await asyncio.wait_for(asyncio.gather(
            batches.write(plane, peer, first, [10]), batches.write(plane, peer, second, [11]),
            batches.write(plane, peer, _ticket(plane, (3,)), [12])), timeout=10)
        assert [r[0] for r in results] == [4 * CELL] * 3
        assert [w[1] for w in plane.writes] == [[1, 3], [2]] and stats.plane_writes == 2

    asyncio.run(run())
