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

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any

import grpc

from gateway.shared_call import SharedCall, status, status_from_wire
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
                return await streams.ask(reserved, request, timeout_s)
            except grpc.aio.AioRpcError as exc:
                if not (streams.failed is exc and exc.code() == grpc.StatusCode.UNIMPLEMENTED
                        and not streams.answered):
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


class PrefillStreamsCall(SharedCall):
    """One PrefillStreams call: each request waits on a future of its own, keyed by its id and
    kind (a request's Prefill and its Reserved may be open at once)."""

    def __init__(self, stub: prefill_pb2_grpc.PrefillStub,
                 on_end: Callable[[SharedCall], None] = lambda ended: None) -> None:
        self._waiting: dict[tuple[bool, str], asyncio.Future] = {}
        self.answered = False  # any answer came: the worker serves the call
        super().__init__(stub.PrefillStreams(), "prefill", on_end)

    async def ask(self, reserved: bool, request: Any, timeout_s: float | None) -> Any:
        if self.failed is not None:
            raise self.failed
        key = (reserved, request.request_id)
        if key in self._waiting:
            raise status(grpc.StatusCode.INVALID_ARGUMENT,
                         f"request {request.request_id!r} is open on this stream already")
        answer = self._waiting[key] = asyncio.get_running_loop().create_future()
        self.send(prefill_pb2.PrefillStreamsRequest(reserveds=[request]) if reserved
                  else prefill_pb2.PrefillStreamsRequest(prefills=[request]))
        try:
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            self._drop(key)
            raise status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._drop(key)
            raise

    def _drop(self, key: tuple[bool, str]) -> None:
        """A request given up on: a Prefill is cancelled on the worker (a Reserved's answer,
        should it come, is dropped)."""
        if self._waiting.pop(key, None) is not None and not key[0] and self.failed is None:
            self.send(prefill_pb2.PrefillStreamsRequest(cancels=[key[1]]))

    def route(self, reply: prefill_pb2.PrefillStreamsReply) -> None:
        self.answered = True
        for a in reply.answers:
            answer = self._waiting.pop((a.reserved_call, a.request_id), None)
            if answer is None or answer.done():  # given up on meanwhile
                continue
            kind = a.WhichOneof("answer")
            if kind is None or kind == "error_code":
                answer.set_exception(status_from_wire(a.error_code, a.error_message))
            else:
                answer.set_result(getattr(a, kind))

    def end_all(self, failure: grpc.aio.AioRpcError) -> None:
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(failure)
        self._waiting.clear()
