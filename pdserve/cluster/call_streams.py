"""One long-lived call carrying many requests' calls: the worker's side of GenerateStreams
(decode_svc/generate_streams.py) and PrefillStreams (prefill_svc/prefill_streams.py); the
gateway's side is gateway/shared_call.py.

A subclass handles each request message (`handle`): it opens requests, each a task of its own
(`start`), cancels them (`cancel`), or answers at once; whatever is ready to go back is
`add`ed, and `serve` yields it as replies (`take` picks a reply's share, `reply` builds it)
until the call's requests end, or the worker drains (`admitting()` false, `closing` set), and
no request task is open on it. However the call ends, the tasks still open are cancelled (as
their own calls would be).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from pdserve.cluster.grpc_server import status_of


def status_to_wire(exc: BaseException, what: str) -> tuple[int, str]:
    """The status code (its number) and message a request's own call would have failed with,
    as an answer on a shared call carries them (logged under `what`, as `status_of` does)."""
    code, message = status_of(exc, what)
    return code.value[0], message


class CallStreams:
    def __init__(self, admitting: Callable[[], bool], closing: asyncio.Event) -> None:
        self.admitting = admitting
        self.closing = closing
        self.tasks: dict[str, asyncio.Task] = {}  # the open requests', by request id
        self.pending: list[Any] = []  # what goes back in the next replies, in order
        self._ready = asyncio.Event()  # something to send, the requests ended, or closing
        self._reading = True

    async def handle(self, request: Any) -> None:
        raise NotImplementedError

    def reply(self, items: list[Any]) -> Any:
        raise NotImplementedError

    def take(self) -> list[Any]:
        """The next reply's items (all pending by default)."""
        taken, self.pending = self.pending, []
        return taken

    async def serve(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The call's replies until its requests end, or the worker drains, and no request is
        open on it. However it ends, the requests still open are cancelled."""
        reader = asyncio.create_task(self._read(requests))
        closing = asyncio.create_task(self._wake_on_closing())
        try:
            while True:
                if self.pending:
                    yield self.reply(self.take())
                    continue
                if not self.tasks and (not self._reading or not self.admitting()):
                    break
                await self._ready.wait()
                self._ready.clear()
            if reader.done():
                await reader  # its error, if any, ends the call
        finally:
            reader.cancel()
            closing.cancel()
            for task in self.tasks.values():
                task.cancel()

    def start(self, request_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as the request's task (it `add`s what goes back)."""
        self.tasks[request_id] = asyncio.create_task(self._run(request_id, work))

    def cancel(self, request_id: str) -> None:
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def add(self, item: Any) -> None:
        self.pending.append(item)
        self._ready.set()

    async def _run(self, request_id: str, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        finally:
            if self.tasks.get(request_id) is asyncio.current_task():
                del self.tasks[request_id]
            self._ready.set()

    async def _wake_on_closing(self) -> None:
        await self.closing.wait()
        self._ready.set()

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                await self.handle(request)
        finally:
            self._reading = False
            self._ready.set()
