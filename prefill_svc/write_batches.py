"""The data-plane writes of many pushes towards one decode worker, made as one write.

NOTE: a write costs a few tenths of a millisecond however small (a thread hop, the block ids
to the device, a launch, a synchronisation; on the 2-core box a NIXL transfer's preparation),
and at a prefill step's end every push of the step asks for one at once (20-30 of them at
saturation in the load test). So the writes asked for towards one peer while the event loop
runs its callbacks wait for the loop's next turn and go together (on an H200, 16 pushes of
1024 tokens at once took 8.5 ms instead of 19, docs/benchmarks.md):

    push a ─┐ write(ticket a)      ┌─▶ one thread: every ticket's `reading()` held (stale ones
    push b ─┼─▶ [a, b, c] ─────────┘   dropped), one plane.write per layer range with the
    push c ─┘   (this loop turn)       tickets' blocks joined, after each distinct event
            ◀── each push gets its own bytes (or None: stale), or the write's failure

Two tickets of one request never share a write (its `reading()` is one lock, not reentrant:
the second waits for the next turn). A push cancelled before its turn comes is left out; one
cancelled while the write runs is written anyway, as a cancelled single write finished in its
thread (the decode worker fences such writes by time). A failed write fails every push in it
(they share the peer).
PDSERVE_KV_WRITE_BATCHES=0 writes each push's slab alone (for comparisons).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass

from pdserve.cluster.worker import TransferStats
from pdserve.transport.base import DataPlane, Peer
from prefill_svc.push import SlabTicket

BATCHES = os.environ.get("PDSERVE_KV_WRITE_BATCHES", "1") != "0"


@dataclass
class _Asked:
    ticket: SlabTicket
    dst_ids: list[int]  # the peer's blocks for the ticket's blocks
    done: asyncio.Future  # (bytes or None if stale, seconds)


class WriteBatches:
    """Per decode worker, the writes asked for in one event-loop turn, made together."""

    def __init__(self, cell_bytes: int, stats: TransferStats) -> None:
        self.cell_bytes = cell_bytes  # one block of one layer, K and V
        self.stats = stats  # counts the writes made (`plane_writes`)
        self._asked: dict[str, list[_Asked]] = {}  # by peer pool id

    async def write(self, plane: DataPlane, peer: Peer, ticket: SlabTicket,
                    dst_ids: list[int]) -> tuple[int | None, float]:
        """Write the ticket's slab into the peer's blocks `dst_ids`: (bytes, seconds the write
        that carried it took), bytes None if the ticket is stale. ConnectionError if the write
        failed."""
        if not BATCHES:
            results, writes = await asyncio.to_thread(self._write_all, plane, peer,
                                                      [(ticket, dst_ids)])
            self.stats.plane_writes += writes
            return results[0]
        loop = asyncio.get_running_loop()
        key = peer.info.pool_id
        asked = self._asked.setdefault(key, [])
        if not asked:
            loop.call_soon(self._start, key, plane, peer)
        entry = _Asked(ticket, dst_ids, loop.create_future())
        asked.append(entry)
        return await entry.done

    def _start(self, key: str, plane: DataPlane, peer: Peer) -> None:
        entries, watches, later = [], set(), []
        for e in self._asked.pop(key, []):
            if e.done.cancelled():
                continue
            watch = id(e.ticket.watch) if e.ticket.watch is not None else id(e)
            # a request's reading() is one lock, not reentrant: one ticket of it per write
            (later if watch in watches else entries).append(e)
            watches.add(watch)
        if later:
            self._asked[key] = later
            asyncio.get_running_loop().call_soon(self._start, key, plane, peer)
        if entries:
            asyncio.ensure_future(self._run(plane, peer, entries))

    async def _run(self, plane: DataPlane, peer: Peer, entries: list[_Asked]) -> None:
        try:
            results, writes = await asyncio.to_thread(
                self._write_all, plane, peer, [(e.ticket, e.dst_ids) for e in entries])
        except BaseException as exc:  # noqa: BLE001 - every push of the write learns it
            for e in entries:
                if not e.done.done():
                    e.done.set_exception(exc if isinstance(exc, Exception)
                                         else ConnectionError(f"KV write ended: {exc!r}"))
            if not isinstance(exc, Exception):
                raise
            return
        self.stats.plane_writes += writes
        for e, result in zip(entries, results):
            if not e.done.done():
                e.done.set_result(result)

    def _write_all(self, plane: DataPlane, peer: Peer,
                   asked: list[tuple[SlabTicket, list[int]]]
                   ) -> tuple[list[tuple[int | None, float]], int]:
        """In a thread: each current ticket's slab into its peer blocks, one plane.write per
        layer range (each ticket's `reading()` held throughout, so no preemption hands its
        blocks on meanwhile); (each ticket's bytes, None if stale, and the seconds of the
        write that carried it; the writes made)."""
        with contextlib.ExitStack() as held:
            current = [held.enter_context(ticket.reading()) for ticket, _ in asked]
            ranges: dict[tuple[int, int], list[int]] = {}
            for i, (ticket, _) in enumerate(asked):
                if current[i]:
                    l0, l1, _, _ = ticket.slab
                    ranges.setdefault((l0, l1), []).append(i)
            results: list[tuple[int | None, float]] = [(None, 0.0)] * len(asked)
            for layers, members in ranges.items():
                src = [b for i in members for b in asked[i][0].block_ids]
                dst = [b for i in members for b in asked[i][1]]
                events = list({id(t.ready): t.ready for i in members
                               if (t := asked[i][0]).ready is not None}.values())
                start = time.perf_counter()
                plane.write(peer, layers, src, dst,
                            events[0] if len(events) == 1 else events or None)
                seconds = time.perf_counter() - start
                for i in members:  # the write's time shared by bytes
                    blocks = len(asked[i][0].block_ids)
                    results[i] = (blocks * (layers[1] - layers[0]) * self.cell_bytes,
                                  seconds * blocks / len(src))
            return results, len(ranges)
