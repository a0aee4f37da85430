"""Many requests' data-plane pushes over one PushKVStreams call: the receiving side.

NOTE: a data-plane push (cuda_ipc, nixl) carries only a header, a KVWritten range or two and a
commit over gRPC; its bytes move one-sided. Over PushKV each push still opens a stream of its
own, and on a busy prefill worker those streams' setup and callbacks were most of its event
loop's time per prompt. Here a prefill worker keeps one call per decode worker, and each
message carries the chunks of every push that had one ready:

    KVStreamsRequest [ (req a, push 1, header), (req b, push 1, written), (req c, push 2, commit) ]
         │ demultiplexed by (request id, push id)
         ▼
    one chunk queue per open push ─▶ KVReceiver.receive, exactly as for a PushKV stream
         │ its result or error
         ▼
    KVStreamsReply [ (req c, push 2, OK, bytes) ]     outcomes batched as they come

A push ends as over PushKV: its commit (OK), an error (the status code it would have ended
with), or a cut: a `cut` entry (its sender cancelled it), or the call ending while it is open
(the prefill worker stopped or died): `receive` then sees the push cut off and leaves the
blocks reserved for another push, fenced as a vanished PushKV stream's are.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from decode_svc.receiver import KVReceiver, PushCut
from pdserve.cluster.grpc_server import status_of
from pdserve.transport.base import GRPC
from protos import decode_pb2

Key = tuple[str, int]  # (request id, push id)
_CUT = object()  # the sender cut the push
_ENDED = object()  # the call ended with the push open


class PushStreams:
    """Serves one PushKVStreams call: `serve(requests)` yields its replies."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self._queues: dict[Key, asyncio.Queue] = {}
        self._tasks: set[asyncio.Task] = set()  # the open pushes' (held: the loop keeps weak refs)
        self._outcomes: list[decode_pb2.KVPushOutcome] = []
        self._ready = asyncio.Event()  # outcomes to send, or the call's requests ended
        self._reading = True

    async def serve(
        self, requests: AsyncIterator[decode_pb2.KVStreamsRequest]
    ) -> AsyncIterator[decode_pb2.KVStreamsReply]:
        """The call's replies until its requests end and every push on it has ended. However
        the call ends (its requests done, cancelled, failed), the pushes still open are cut."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while self._reading or self._queues or self._outcomes:
                await self._ready.wait()
                self._ready.clear()
                if self._outcomes:
                    outcomes, self._outcomes = self._outcomes, []
                    yield decode_pb2.KVStreamsReply(outcomes=outcomes)
            await reader  # its error, if any, ends the call
        finally:
            reader.cancel()
            self._end_all()

    async def _read(self, requests: AsyncIterator[decode_pb2.KVStreamsRequest]) -> None:
        try:
            async for request in requests:
                for entry in request.chunks:
                    self._route(entry)
        finally:
            self._reading = False
            self._end_all()
            self._ready.set()

    def _route(self, entry: decode_pb2.KVStreamChunk) -> None:
        """Hand the entry to its push's queue; a header opens the push."""
        key = (entry.request_id, entry.push_id)
        queue = self._queues.get(key)
        if entry.WhichOneof("entry") == "cut":
            if queue is not None:
                queue.put_nowait(_CUT)
            return  # a push that ended already (its outcome is on its way): nothing to cut
        if queue is None:
            if entry.chunk.WhichOneof("chunk") != "header":
                self._done(key, ValueError(
                    f"no open push {entry.push_id} of request {entry.request_id!r} on this "
                    "stream: its chunks come after its header"))
                return
            queue = self._open(key, entry.chunk.header)
            if queue is None:
                return
        queue.put_nowait(entry.chunk)

    def _open(self, key: Key, header: decode_pb2.KVHeader) -> asyncio.Queue | None:
        """A new push's queue and the task receiving it; None (its outcome an error) if the
        header cannot open a push here."""
        if (header.transport or GRPC) == GRPC:
            self._done(key, ValueError(
                "a grpc push's slabs travel on PushKV, not PushKVStreams"))
            return None
        if (header.request_id, header.push_id) != key:
            self._done(key, ValueError(
                f"the header names push {header.push_id} of request {header.request_id!r}, "
                f"its entry push {key[1]} of {key[0]!r}"))
            return None
        queue = self._queues[key] = asyncio.Queue()
        task = asyncio.create_task(self._receive(key, queue))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return queue

    async def _receive(self, key: Key, queue: asyncio.Queue) -> None:
        try:
            received = await self.receiver.receive(_chunks(queue))
        except Exception as exc:  # noqa: BLE001 - every error becomes the push's outcome
            self._done(key, exc)
        else:
            self._done(key, None, received)
        finally:
            self._queues.pop(key, None)
            self._ready.set()

    def _done(self, key: Key, exc: BaseException | None, received: int = 0) -> None:
        outcome = decode_pb2.KVPushOutcome(request_id=key[0], push_id=key[1],
                                           bytes_received=received)
        if exc is not None:
            code, outcome.message = status_of(exc, f"[{key[0]}] KV push {key[1]}")
            outcome.code = code.value[0]
        else:
            self.receiver.stats.shared_stream += 1
        self._outcomes.append(outcome)
        self._ready.set()

    def _end_all(self) -> None:
        """The call ended: every push still open on it is cut off."""
        for queue in self._queues.values():
            queue.put_nowait(_ENDED)


async def _chunks(queue: asyncio.Queue) -> AsyncIterator[decode_pb2.KVChunk]:
    """One push's chunks, as a PushKV stream's, ending after its commit; PushCut when it is
    cut, an early end when the call ended with it open (both: `receive` leaves the request to
    another push)."""
    while True:
        item = await queue.get()
        if item is _CUT:
            raise PushCut("the push was cancelled by its sender")
        if item is _ENDED:
            return
        yield item
        if item.WhichOneof("chunk") == "commit":
            return
