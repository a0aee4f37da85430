"""Many requests' Generate streams over one GenerateStreams call per decode worker: the
gateway's side (decode_svc/generate_streams.py says why).

A request on the shared call reads as its own Generate call would: `read()` gives its messages,
then `grpc.aio.EOF`, or raises `grpc.aio.AioRpcError` with the status its Generate would have
ended with; `cancel()` cancels it; its deadline is its own. So `RemoteBackend` reads either
kind alike. The call is opened on a channel's first request and kept while it works; when it
fails (the worker died, the channel was retired), every request open on it fails with its
status (UNAVAILABLE: the requests move to another worker), and the next request opens a new
one. A decode worker of an earlier version answers UNIMPLEMENTED: its requests, that one
included, take a Generate call each.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any

import grpc

from gateway.shared_call import SharedCall, status, status_from_wire
from protos import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class GenerateCalls:
    """`open(channel, request, timeout_s)`: the request's call, on the channel's shared
    GenerateStreams call, or a Generate call of its own (`shared` false, or a worker that
    serves no GenerateStreams)."""

    def __init__(self, shared: bool = True) -> None:
        self.shared = shared
        # the working call of each channel; a call that ended leaves (so does its channel)
        self._calls: dict[grpc.aio.Channel, StreamsCall] = {}
        self._unsupported: weakref.WeakSet[grpc.aio.Channel] = weakref.WeakSet()

    def open(self, channel: grpc.aio.Channel, request: decode_pb2.GenerateRequest,
             timeout_s: float | None) -> Any:
        if not self.shared or channel in self._unsupported:
            return _own_call(channel, request, timeout_s)
        streams = self._calls.get(channel)
        if streams is None or streams.failed:
            streams = self._calls[channel] = StreamsCall(
                decode_pb2_grpc.DecodeStub(channel),
                on_end=lambda ended: self._forget(channel, ended))
        return streams.open(request, timeout_s,
                            fallback=lambda: self._fall_back(channel, request, timeout_s))

    def _forget(self, channel: grpc.aio.Channel, ended: StreamsCall) -> None:
        if self._calls.get(channel) is ended:
            del self._calls[channel]

    def _fall_back(self, channel: grpc.aio.Channel, request: decode_pb2.GenerateRequest,
                   timeout_s: float | None) -> Any:
        if channel not in self._unsupported:
            logger.info("a decode worker serves no GenerateStreams (an earlier version): a "
                        "Generate call per request there")
            self._unsupported.add(channel)
        return _own_call(channel, request, timeout_s)


def _own_call(channel: grpc.aio.Channel, request: decode_pb2.GenerateRequest,
              timeout_s: float | None) -> Any:
    return decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=timeout_s)


class StreamsCall(SharedCall):
    """One GenerateStreams call: opens and cancels written in order, replies handed to each
    request's `RequestCall` (gateway/shared_call.py)."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub,
                 on_end: Callable[[SharedCall], None] = lambda ended: None) -> None:
        self._open: dict[str, RequestCall] = {}
        super().__init__(stub.GenerateStreams(), "the decode worker", on_end)

    def open(self, request: decode_pb2.GenerateRequest, timeout_s: float | None,
             fallback: Any) -> RequestCall:
        call = RequestCall(self, request.request_id, timeout_s, fallback)
        if request.request_id in self._open:
            call.end(status(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request {request.request_id!r} is open on this stream already"))
            return call
        self._open[request.request_id] = call
        self.send(decode_pb2.GenerateStreamsRequest(opens=[request]))
        return call

    def cancel(self, request_id: str) -> None:
        if self._open.pop(request_id, None) is not None:
            self.send(decode_pb2.GenerateStreamsRequest(cancels=[request_id]))

    def route(self, reply: decode_pb2.GenerateStreamsReply) -> None:
        for event in reply.events:
            call = self._open.get(event.request_id)
            if call is None:  # cancelled meanwhile
                continue
            if event.WhichOneof("event") == "response":
                call.put(event.response)
                continue
            del self._open[event.request_id]
            call.end(None if event.end_code == 0
                     else status_from_wire(event.end_code, event.end_message))

    def end_all(self, failure: grpc.aio.AioRpcError) -> None:
        for call in list(self._open.values()):
            call.end(failure)
        self._open.clear()


class RequestCall:
    """One request on a `StreamsCall`, with a Generate call's `read()` and `cancel()`."""

    def __init__(self, streams: StreamsCall, request_id: str, timeout_s: float | None,
                 fallback: Any) -> None:
        self._streams = streams
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ended = False  # its end is in the queue (or it was cancelled)
        self._fallback = fallback
        self._own: Any = None  # its own Generate call, after an UNIMPLEMENTED
        self._read_any = False
        loop = asyncio.get_running_loop()
        self._timer = None if timeout_s is None else loop.call_later(
            timeout_s, self._expire)

    def put(self, message: decode_pb2.GenerateResponse) -> None:
        self._queue.put_nowait(message)

    def end(self, failure: grpc.aio.AioRpcError | None) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put_nowait(grpc.aio.EOF if failure is None else failure)
            if self._timer is not None:
                self._timer.cancel()

    def _expire(self) -> None:
        if not self._ended:
            self._streams.cancel(self.request_id)
            self.end(status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    async def read(self) -> Any:
        if self._own is not None:
            return await self._own.read()
        item = await self._queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            if item.code() == grpc.StatusCode.UNIMPLEMENTED and not self._read_any:
                self._own = self._fallback()  # nothing reached the worker: ask it alone
                return await self._own.read()
            self._queue.put_nowait(item)  # every later read fails alike
            raise item
        if item is grpc.aio.EOF:
            self._queue.put_nowait(item)
        self._read_any = True
        return item

    def cancel(self) -> bool:
        if self._own is not None:
            return self._own.cancel()
        if self._timer is not None:
            self._timer.cancel()
        if self._ended:
            return False
        self._ended = True
        self._streams.cancel(self.request_id)
        return True
