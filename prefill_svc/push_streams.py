"""Many requests' data-plane pushes over one PushKVStreams call: the sending side.

NOTE: one call per decode worker, opened by the first data-plane push towards it and kept
open; each push feeds its chunks (header, KVWritten, commit) into it and waits for its
outcome (decode_svc/push_streams.py has the receiving side and why):

    push a ─┐  chunks queued on the event loop       ┌─▶ writer: everything queued by then in
    push b ─┼─▶ [(a, header), (b, commit), ...] ─────┘   one KVStreamsRequest, then the next
    push c ─┘
                outcomes ◀── reader: each KVStreamsReply's outcomes resolve their pushes

A push ends as over a PushKV stream of its own: its outcome (the bytes accepted, or the status
code PushKV would have ended with), or, if it is cancelled or fails here first, a `cut` entry
that the decode worker treats as a cancelled PushKV (the blocks stay reserved for another
push). An outcome that fails a push while it is still writing stops its chunks, as a failed
PushKV cancels its request iterator. The call failing fails every push open on it
(`StreamsFailed`, with the call's status code) and the next push opens a new call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

import grpc

from protos import decode_pb2

logger = logging.getLogger(__name__)


def decode_rpc_path(method: str) -> str:
    """The path of one of the Decode service's rpcs, as a channel's multicallables take it."""
    rpc = decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name[method]
    return f"/{rpc.containing_service.full_name}/{rpc.name}"


PUSH_KV_STREAMS = decode_rpc_path("PushKVStreams")
Key = tuple[str, int]  # (request id, push id)


class PushFailed(ConnectionError):
    """The decode worker ended the push with an error: its status `code` and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamsFailed(PushFailed):
    """The call carrying the push failed (every push open on it fails alike)."""


class PushStreamsCall:
    """One PushKVStreams call to a decode worker, shared by every push towards it."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self.address = address
        self._call: grpc.aio.StreamStreamCall | None = channel.stream_stream(
            PUSH_KV_STREAMS, request_serializer=decode_pb2.KVStreamsRequest.SerializeToString,
            response_deserializer=decode_pb2.KVStreamsReply.FromString)()
        self._queued: list[decode_pb2.KVStreamChunk] = []
        self._wake = asyncio.Event()
        self._waiting: dict[Key, asyncio.Future] = {}
        self.failed: StreamsFailed | None = None  # set once the call is over
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    async def push(self, request_id: str, push_id: int,
                   chunks: AsyncGenerator[decode_pb2.KVChunk, None], timeout_s: float) -> int:
        """Send the push's chunks as they come and wait for its outcome: the bytes the decode
        worker accepted. PushFailed (its code and message) if it refused the push or the call
        failed; ConnectionError after `timeout_s`. Cancelled or failed here, the push is cut."""
        if self.failed is not None:
            raise self.failed
        key = (request_id, push_id)
        if key in self._waiting:
            raise ValueError(f"push {push_id} of request {request_id!r} is already open")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        outcome = self._waiting[key] = loop.create_future()
        feeding = asyncio.ensure_future(self._feed(key, chunks))
        ended = False
        try:
            done, _ = await asyncio.wait({feeding, outcome}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if feeding in done and outcome not in done:
                feeding.result()  # its chunks failed here: raise (the push is cut below)
                await asyncio.wait({outcome}, timeout=max(0.0, deadline - loop.time()))
            if not outcome.done():
                raise ConnectionError(f"KV push to {self.address} timed out after "
                                      f"{timeout_s:g} s")
            ended = True
            return outcome.result()
        finally:
            feeding.cancel()  # an outcome came first (a failure): no more chunks
            self._waiting.pop(key, None)
            if not ended and self.failed is None:
                self._send(decode_pb2.KVStreamChunk(request_id=request_id, push_id=push_id,
                                                    cut=True))

    async def _feed(self, key: Key, chunks: AsyncGenerator[decode_pb2.KVChunk, None]) -> None:
        try:
            async for chunk in chunks:
                self._send(decode_pb2.KVStreamChunk(request_id=key[0], push_id=key[1],
                                                    chunk=chunk))
        finally:
            await chunks.aclose()  # a data-plane push's pending write is cancelled

    def _send(self, entry: decode_pb2.KVStreamChunk) -> None:
        self._queued.append(entry)
        self._wake.set()

    async def _write(self) -> None:
        """Every chunk queued since the last message, in one message."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                entries, self._queued = self._queued, []
                if not entries:  # taken by the previous message already
                    continue
                assert self._call is not None  # this task is cancelled once it is gone
                await self._call.write(decode_pb2.KVStreamsRequest(chunks=entries))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader reports the call's status
            logger.debug("PushKVStreams to %s: write failed: %s", self.address, exc)

    async def _read(self) -> None:
        failed = StreamsFailed(grpc.StatusCode.UNKNOWN,
                               f"the KV push stream to {self.address} failed")
        assert self._call is not None
        try:
            async for reply in self._call:
                for o in reply.outcomes:
                    waiter = self._waiting.get((o.request_id, o.push_id))
                    if waiter is None or waiter.done():
                        continue
                    if o.code == grpc.StatusCode.OK.value[0]:
                        waiter.set_result(o.bytes_received)
                    else:
                        waiter.set_exception(PushFailed(_code(o.code), o.message))
            failed = StreamsFailed(grpc.StatusCode.UNAVAILABLE,
                                   f"the KV push stream to {self.address} ended")
        except grpc.aio.AioRpcError as exc:
            failed = StreamsFailed(exc.code(), exc.details() or exc.code().name)
        except asyncio.CancelledError:
            failed = StreamsFailed(grpc.StatusCode.CANCELLED, "the KV push stream was closed")
            raise
        finally:
            self._fail_all(failed)

    def _fail_all(self, failed: StreamsFailed) -> None:
        """The call is over: fail its pushes and let go of it (a call object kept alive keeps
        its connection's state too, the reconnect backoff after a peer died included, and a new
        channel to the same address would share it and fail at once)."""
        self.failed = failed
        self._call = None
        self._writer.cancel()
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(failed)

    async def close(self) -> None:
        """Cut the pushes still open (the decode worker keeps their blocks reserved) and end
        the call."""
        self._writer.cancel()
        if self._call is not None:
            self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._writer, self._reader)


def _code(number: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN
