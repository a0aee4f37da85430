"""One long-lived bidirectional call carrying many requests to a worker: the gateway's side of
GenerateStreams (gateway/generate_streams.py), PrefillStreams (gateway/prefill_calls.py) and
TokenizeStreams (gateway/remote_tokenizer.py); the worker's side is
pdserve/cluster/call_streams.py. `AnsweredCall`: one whose requests each wait for one answer.

What is sent in one event-loop turn goes as one message (the messages' repeated fields joined);
one task reads the replies and hands each to `route`. When the call ends (the worker died or
ended it, the channel was retired, the gateway cancelled it), `failed` holds the status every
request still open on it fails with (UNAVAILABLE when the worker ended it cleanly: the requests
move to another worker) and `end_all` gives it to them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

CODES = {code.value[0]: code for code in grpc.StatusCode}  # by the number on the wire


def status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a call of its own would have raised with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def status_from_wire(code: int, details: str) -> grpc.aio.AioRpcError:
    return status(CODES.get(code, grpc.StatusCode.UNKNOWN), details)


class SharedCall:
    """A call of `stream_stream` kind, opened at once; subclasses define `route(reply)` and
    `end_all(failure)`. `on_end(self)` runs once the call ended."""

    def __init__(self, call: Any, peer: str,
                 on_end: Callable[[SharedCall], None] = lambda ended: None) -> None:
        self._call = call
        self._peer = peer  # "the decode worker", ...: who ended the call, in its status
        self._on_end = on_end
        self._outbox: list[Any] = []
        self._wrote = asyncio.Event()
        self.failed: grpc.aio.AioRpcError | None = None
        self._tasks = {asyncio.create_task(self._write()), asyncio.create_task(self._read())}

    def send(self, message: Any) -> None:
        self._outbox.append(message)
        self._wrote.set()

    def route(self, reply: Any) -> None:
        raise NotImplementedError

    def end_all(self, failure: grpc.aio.AioRpcError) -> None:
        raise NotImplementedError

    async def _write(self) -> None:
        """What was sent in one event-loop turn goes as one message."""
        try:
            while True:
                await self._wrote.wait()
                self._wrote.clear()
                taken, self._outbox = self._outbox, []
                message = type(taken[0])()
                for m in taken:
                    message.MergeFrom(m)  # repeated fields: appended in order
                await self._call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the call ended: `_read` tells the requests why

    async def _read(self) -> None:
        failure = status(grpc.StatusCode.UNAVAILABLE, f"{self._peer} ended the stream")
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    break
                self.route(reply)
        except grpc.aio.AioRpcError as exc:
            failure = exc
        except asyncio.CancelledError:
            failure = status(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
            raise
        finally:
            self.failed = failure
            self._on_end(self)
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            self.end_all(failure)


class AnsweredCall(SharedCall):
    """A shared call whose requests each wait for one answer, found by a key of the caller's:
    `ask` sends a request's message and waits for its answer (`answer`, from the subclass's
    `route`) as a call of its own would: its response, or `grpc.aio.AioRpcError` with its
    status; at its deadline DEADLINE_EXCEEDED. A request given up on (its deadline, its task
    cancelled) sends `cancel_message(key)` if there is one; its answer, should it come, is
    dropped."""

    def __init__(self, call: Any, peer: str,
                 on_end: Callable[[SharedCall], None] = lambda ended: None) -> None:
        self._waiting: dict[Any, asyncio.Future] = {}
        self.answered = False  # any answer came: the peer serves the call
        super().__init__(call, peer, on_end)

    def cancel_message(self, key: Any) -> Any | None:
        return None

    def unserved(self, exc: grpc.aio.AioRpcError) -> bool:
        """Whether `exc` says the peer serves no such call (an earlier version: UNIMPLEMENTED
        before any answer), so nothing sent on it reached the peer: ask it a call each."""
        return (self.failed is exc and exc.code() == grpc.StatusCode.UNIMPLEMENTED
                and not self.answered)

    async def ask(self, key: Any, message: Any, timeout_s: float | None,
                  what: str = "") -> Any:
        """`what` names the request in the error of a key already waiting."""
        if self.failed is not None:
            raise self.failed
        if key in self._waiting:
            raise status(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what or repr(key)} is open on this stream already")
        answer = self._waiting[key] = asyncio.get_running_loop().create_future()
        self.send(message)
        try:
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            self._drop(key)
            raise status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._drop(key)
            raise

    def answer(self, key: Any, result: Any = None,
               error: grpc.aio.AioRpcError | None = None) -> None:
        self.answered = True
        waiting = self._waiting.pop(key, None)
        if waiting is None or waiting.done():  # given up on meanwhile
            return
        if error is not None:
            waiting.set_exception(error)
        else:
            waiting.set_result(result)

    def end_all(self, failure: grpc.aio.AioRpcError) -> None:
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(failure)
        self._waiting.clear()

    def _drop(self, key: Any) -> None:
        if self._waiting.pop(key, None) is not None and self.failed is None:
            cancel = self.cancel_message(key)
            if cancel is not None:
                self.send(cancel)
