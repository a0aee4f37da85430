"""Many requests' Generate streams over one GenerateStreams call: the decode worker's side.

NOTE: over Generate each request is a stream of its own, and every decode step writes one
message on each: with 64 requests running, 64 gRPC writes a step, each a few event-loop turns
and a completion from grpc's poller thread, all holding the GIL that the engine thread needs
for its next step (on an H200 at saturation the decode step's host time grew by ~3 ms). Here a
gateway keeps one call per decode worker; a step's outputs of every request on it leave as one
reply:

    GenerateStreamsRequest [ open a, open b, cancel c ]
         │ each open runs DecodeServicer.Generate, exactly as its own call would
         ▼
    one task per open request ──▶ its messages, then its end (OK or its status) ─▶ outbox
                                                                                    │
    GenerateStreamsReply [ (a, msg), (b, msg), (d, end OK) ] ◀── all that is ready ─┘

The engine hands a step's outputs to the event loop in one callback, so every request's task
has run to its next message before the writer runs: a reply per step, fewer when a write is
slow (they then join the next reply). A request's end event follows its last message; a
cancelled request gets none. The call ending (the gateway went away or cancelled it) cancels
every request still open on it, as a cancelled Generate would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pdserve.cluster.call_streams import CallStreams, status_to_wire
from protos import decode_pb2

MAX_EVENTS = 1024  # per reply: a backlog of many steps leaves as several replies, each well
# within the 16 MiB message limit in practice (an event is what one Generate message was; a
# token with 20 logprobs takes ~200 bytes)
Generate = Callable[[decode_pb2.GenerateRequest, Any], AsyncIterator[decode_pb2.GenerateResponse]]


class GenerateStreams(CallStreams):
    """Serves one GenerateStreams call: `serve(requests)` yields its replies
    (pdserve/cluster/call_streams.py). `admitting()` false (the worker drains): opens end
    UNAVAILABLE, and the call ends once none is open."""

    def __init__(self, generate: Generate, admitting: Callable[[], bool],
                 closing: asyncio.Event) -> None:
        super().__init__(admitting, closing)
        self.generate = generate

    async def handle(self, request: decode_pb2.GenerateStreamsRequest) -> None:
        for request_id in request.cancels:
            self.cancel(request_id)
        for opened in request.opens:
            self._open(opened)

    def take(self) -> list[decode_pb2.GenerateStreamEvent]:
        taken = self.pending[:MAX_EVENTS]
        del self.pending[:MAX_EVENTS]
        return taken

    def reply(self, items: list[decode_pb2.GenerateStreamEvent]) -> Any:
        return decode_pb2.GenerateStreamsReply(events=items)

    def _open(self, request: decode_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        if not self.admitting():
            self._end(request_id, ConnectionError("the decode worker is draining"))
        elif request_id in self.tasks:
            self._end(request_id, ValueError(
                f"request {request_id!r} is open on this stream already"))
        else:
            self.start(request_id, self._run_generate(request))

    async def _run_generate(self, request: decode_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        try:
            async with aclosing(self.generate(request, None)) as messages:
                async for msg in messages:
                    self.add(decode_pb2.GenerateStreamEvent(request_id=request_id,
                                                            response=msg))
        except Exception as exc:  # noqa: BLE001 - every error becomes the request's end
            self._end(request_id, exc)  # (a cancelled one gets none: Generate's cleanup ran)
        else:
            self._end(request_id, None)

    def _end(self, request_id: str, exc: BaseException | None) -> None:
        event = decode_pb2.GenerateStreamEvent(request_id=request_id, end_code=0)
        if exc is not None:  # the status and details its own Generate call would end with
            event.end_code, event.end_message = status_to_wire(exc, f"[{request_id}] Generate")
        self.add(event)
