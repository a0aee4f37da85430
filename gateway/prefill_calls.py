"""A request's Prefill and Reserved as messages on one PrefillStreams call per prefill worker:
the gateway's side (prefill_svc/prefill_streams.py says why).

`prefill(channel, request, timeout_s)` and `reserved(...)` answer as the unary calls would:
the response, or `grpc.aio.AioRpcError` with the status that call would have ended with. The
request's deadline is its own (at its end the Prefill is cancelled on the worker:
DEADLINE_EXCEEDED); cancelling the awaiting task cancels the Prefill there, as cancelling its
call would. The shared call is opened on a channel's first request and kept while it works;
when it fails (the worker died, the channel was retired), every request waiting on it fails
with its status (UNAVAILABLE: the gateway moves them to another worker), and the next request
opens a new one. A prefill worker of an earlier version answers UNIMPLEMENTED: its requests,
that one included, take a call each.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import grpc

from gateway.shared_call import AnsweredCall, SharedCall, status_from_wire
from protos import prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillCalls:
    """The gateway's Prefill and Reserved calls: on each channel's shared PrefillStreams call,
    or a call each (`shared` false, or a worker that serves no PrefillStreams)."""

    def __init__(self, shared: bool = True) -> None:
        self.shared = shared
        self._calls: dict[grpc.aio.Channel, PrefillStreamsCall] = {}  # each channel's working one
        self._unsupported: weakref.WeakSet[grpc.aio.Channel] = weakref.WeakSet()

    async def prefill(self, channel: grpc.aio.Channel, request: prefill_pb2.PrefillRequest,
                      timeout_s: float | None) -> prefill_pb2.PrefillResponse:
        return await self._ask(channel, False, request, timeout_s)

    async def reserved(self, channel: grpc.aio.Channel, request: prefill_pb2.ReservedRequest,
                       timeout_s: float | None) -> prefill_pb2.ReservedResponse:
        return await self._ask(channel, True, request, timeout_s)

    async def _ask(self, channel: grpc.aio.Channel, reserved: bool, request: Any,
                   timeout_s: float | None) -> Any:
        if self.shared and channel not in self._unsupported:
            streams = self._calls.get(channel)
            if streams is None or streams.failed:
                streams = self._calls[channel] = PrefillStreamsCall(
                    prefill_pb2_grpc.PrefillStub(channel),
                    on_end=lambda ended: self._forget(channel, ended))
            try:
                return await streams.ask_prefill(reserved, request, timeout_s)
            except grpc.aio.AioRpcError as exc:
                if not streams.unserved(exc):
                    raise
                self._fall_back(channel)  # nothing reached the worker: ask it alone
        stub = prefill_pb2_grpc.PrefillStub(channel)
        rpc = stub.Reserved if reserved else stub.Prefill
        return await rpc(request, timeout=timeout_s)

    def _forget(self, channel: grpc.aio.Channel, ended: SharedCall) -> None:
        if self._calls.get(channel) is ended:
            del self._calls[channel]

    def _fall_back(self, channel: grpc.aio.Channel) -> None:
        if channel not in self._unsupported:
            logger.info("a prefill worker serves no PrefillStreams (an earlier version): a "
                        "Prefill call per request there")
            self._unsupported.add(channel)


class PrefillStreamsCall(AnsweredCall):
    """One PrefillStreams call: each request's answer found by its kind and id (a request's
    Prefill and its Reserved may be open at once)."""

    def __init__(self, stub: prefill_pb2_grpc.PrefillStub,
                 on_end: Callable[[SharedCall], None] = lambda ended: None) -> None:
        super().__init__(stub.PrefillStreams(), "the prefill worker", on_end)

    async def ask_prefill(self, reserved: bool, request: Any, timeout_s: float | None) -> Any:
        message = (prefill_pb2.PrefillStreamsRequest(reserveds=[request]) if reserved
                   else prefill_pb2.PrefillStreamsRequest(prefills=[request]))
        return await self.ask((reserved, request.request_id), message, timeout_s,
                              f"request {request.request_id!r}")

    def cancel_message(self, key: tuple[bool, str]) -> Any | None:
        """A Prefill is cancelled on the worker (a Reserved is answered at once there)."""
        reserved, request_id = key
        return None if reserved else prefill_pb2.PrefillStreamsRequest(cancels=[request_id])

    def route(self, reply: prefill_pb2.PrefillStreamsReply) -> None:
        for a in reply.answers:
            kind = a.WhichOneof("answer")
            if kind is None or kind == "error_code":
                self.answer((a.reserved_call, a.request_id),
                            error=status_from_wire(a.error_code, a.error_message))
            else:
                self.answer((a.reserved_call, a.request_id), getattr(a, kind))
