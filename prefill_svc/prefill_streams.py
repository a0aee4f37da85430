"""Many requests' Prefill and Reserved calls over one PrefillStreams call: the prefill worker's
side (the gateway's: gateway/prefill_calls.py).

NOTE: why. A request's Prefill is the split's one control-plane call on its first token's way
that colocated serving does not make, and at a low request rate it finds both processes idle:
a new unary call then passes gRPC core's threads, each woken from sleep, before the handler
runs. On the 2-core box (2026-12-07, `python -m pdserve.bench.grpc_ping --calls 200 --gap-ms
50`, the modes taking turns) a unary call's way there and back took 1.12 + 0.45 ms (p50) where
a message each way on a call kept open took 0.55 + 0.29; with 5 ms between calls 0.66 + 0.30
against 0.28 + 0.19; on an H100 host at 16 req/s the Prefill's way there went from 1.1 to 0.6 ms
(docs/loadtest.md, "The split's Prefill on a call kept open"). So a gateway keeps one call per
prefill worker and sends each Prefill (and the Reserved that follows it) as a message on it:

    PrefillStreamsRequest [ prefill a, reserved b, cancel c ]
         │ each prefill runs PrefillServicer.Prefill in a task of its own, each reserved
         ▼ PrefillServicer.Reserved at once, exactly as their own calls would
    PrefillStreamsReply [ (b, reserved), (a, response), (d, error code and message) ]

A cancelled Prefill gets no answer (its task's cancellation runs the cleanup a cancelled call
would). The call ending (the gateway went away, or cancelled it) cancels every Prefill still
open on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.cluster.call_streams import CallStreams, status_to_wire
from protos import prefill_pb2

# A reply carries answers up to this many bytes (at least one): a Prefill's answer with prompt
# logprobs runs to megabytes for a long prompt, and several in one reply must stay well within
# the 16 MiB message limit (MAX_MESSAGE_BYTES).
MAX_REPLY_BYTES = 4 << 20
Unary = Callable[[Any, Any], Awaitable[Any]]


class PrefillStreams(CallStreams):
    """Serves one PrefillStreams call: `serve(requests)` yields its replies
    (pdserve/cluster/call_streams.py). `admitting()` false (the worker drains): opens end
    UNAVAILABLE, Reserveds are still answered, and the call ends once no Prefill is open."""

    def __init__(self, prefill: Unary, reserved: Unary, admitting: Callable[[], bool],
                 closing: asyncio.Event) -> None:
        super().__init__(admitting, closing)
        self.prefill = prefill
        self.reserved = reserved

    async def handle(self, request: prefill_pb2.PrefillStreamsRequest) -> None:
        for request_id in request.cancels:
            self.cancel(request_id)
        for told in request.reserveds:
            await self._tell(told)
        for opened in request.prefills:
            self._open(opened)

    def take(self) -> list[prefill_pb2.PrefillStreamAnswer]:
        """The next reply's answers: in order, up to MAX_REPLY_BYTES (at least one)."""
        size, n = 0, 0
        for answer in self.pending:
            size += answer.ByteSize()
            if n and size > MAX_REPLY_BYTES:
                break
            n += 1
        taken = self.pending[:n]
        del self.pending[:n]
        return taken

    def reply(self, items: list[prefill_pb2.PrefillStreamAnswer]) -> Any:
        return prefill_pb2.PrefillStreamsReply(answers=items)

    async def _tell(self, request: prefill_pb2.ReservedRequest) -> None:
        answer = prefill_pb2.PrefillStreamAnswer(request_id=request.request_id,
                                                 reserved_call=True)
        try:
            answer.reserved.CopyFrom(await self.reserved(request, None))
        except Exception as exc:  # noqa: BLE001 - the status its own call would end with
            _fail(answer, exc, "Reserved")
        self.add(answer)

    def _open(self, request: prefill_pb2.PrefillRequest) -> None:
        request_id = request.request_id
        answer = prefill_pb2.PrefillStreamAnswer(request_id=request_id)
        if not self.admitting():
            _fail(answer, ConnectionError("the prefill worker is shutting down"), "Prefill")
            self.add(answer)
        elif request_id in self.tasks:
            _fail(answer, ValueError(f"request {request_id!r} is open on this stream already"),
                  "Prefill")
            self.add(answer)
        else:
            self.start(request_id, self._run_prefill(request, answer))

    async def _run_prefill(self, request: prefill_pb2.PrefillRequest,
                           answer: prefill_pb2.PrefillStreamAnswer) -> None:
        try:
            answer.prefill.CopyFrom(await self.prefill(request, None))
        except Exception as exc:  # noqa: BLE001 - every error becomes the request's answer
            _fail(answer, exc, "Prefill")  # (a cancelled one gets none)
        self.add(answer)


def _fail(answer: prefill_pb2.PrefillStreamAnswer, exc: BaseException, rpc: str) -> None:
    answer.error_code, answer.error_message = status_to_wire(exc,
                                                             f"[{answer.request_id}] {rpc}")
