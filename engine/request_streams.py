"""Each open request's output queue, on the event loop of the caller reading it.

`AsyncLLMEngine` (engine thread) and `EngineCoreClient` (engine core process) both hand a
request's outputs from another thread to the caller's event loop and read them back there the
same way: a stream ends at the request's final output, at `end()` (aborted), at a per-request
failure, or at the engine's failure; a reader that leaves early aborts the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.outputs import RequestOutput

_ENDED = object()  # ends a stream whose request was aborted through the engine's `abort()`


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; no request can make progress."""


class RequestFailed:
    """Ends one request's stream with `exc` (the engine loop itself is fine)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class RequestStreams:
    def __init__(self, dead_message: str) -> None:
        self.dead_message = dead_message  # what EngineDeadError says when the engine failed
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def open(self, request_id: str) -> None:
        """A queue for the request on the running loop; ValueError if the id is open already."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = (asyncio.get_running_loop(), asyncio.Queue())

    def discard(self, request_id: str) -> None:
        """Forget the request's queue (nobody reads it)."""
        self._streams.pop(request_id, None)

    def end(self, request_id: str) -> None:
        """End the request's stream without a final output (it was aborted)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream[0].call_soon_threadsafe(stream[1].put_nowait, _ENDED)

    def put(self, request_id: str, item: RequestOutput | RequestFailed | BaseException) -> None:
        """From any thread: an output, a request's failure or the engine's, to its reader."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream[0].call_soon_threadsafe(stream[1].put_nowait, item)

    def output_calls(self, outputs: list[RequestOutput]) -> list[tuple[Any, Any, Any]]:
        """The (loop, fn, arg) calls that hand `outputs` to their readers (engine/loop_hops.py
        makes them one hop per loop)."""
        calls = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                calls.append((stream[0], stream[1].put_nowait, out))
        return calls

    def fail_all(self, exc: BaseException) -> None:
        """The engine failed: every open stream raises EngineDeadError from `exc`."""
        for request_id in list(self._streams):
            self.put(request_id, exc)

    async def consume(self, request_id: str,
                      abort: Callable[[], Awaitable[Any]]) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; a reader leaving before that (and before
        the stream ended otherwise) runs `abort()`."""
        q = self._streams[request_id][1]
        finished = False
        try:
            while not finished:
                item = await q.get()
                if item is _ENDED:
                    return
                if isinstance(item, RequestFailed):
                    raise RuntimeError(f"request {request_id!r} failed: {item.exc}") from item.exc
                if isinstance(item, BaseException):
                    raise EngineDeadError(self.dead_message) from item
                finished = item.finished
                yield item
        finally:
            stream = self._streams.pop(request_id, None)
            if not finished and stream is not None:
                await asyncio.shield(abort())


def settle(future: asyncio.Future | concurrent.futures.Future, result: Any,
           exc: BaseException | None) -> None:
    """Its result, or `exc`, unless it is cancelled or settled: an asyncio future's on its
    loop, a `concurrent.futures.Future`'s from any thread."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
