"""Cancellation that reaches every worker holding a request.

The gateway cancels a request twice over: it cancels its gRPC calls, and it records the
cancellation in Redis (a stored flag plus a pub/sub message, `RequestStore.cancel`). A worker
runs a `CancelWatch`: the message aborts what it holds now; the flag, checked on admission,
refuses a request whose cancellation overtook it (pub/sub drops messages nobody listened to).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pdserve.cluster.state import DEFAULT_PREFIX, RequestStore, StateStoreError, connect

logger = logging.getLogger(__name__)


class RequestCancelled(Exception):
    """The request was cancelled before this worker admitted it."""


class _CheckSoon:
    """What both watches share: a check started now and awaited later."""

    async def check(self, request_id: str) -> None:
        raise NotImplementedError

    def check_soon(self, request_id: str) -> asyncio.Task[None]:
        """`check` started now, awaited later, before the request's result leaves this worker:
        its Redis round trip then runs beside the request's work instead of before it (a
        request cancelled before it came here is rare; its work is then undone). The task's
        error is consumed when nobody awaits it (the work failed first)."""
        task = asyncio.ensure_future(self.check(request_id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task


class CancelWatch(_CheckSoon):
    def __init__(
        self, redis_url: str, on_cancel: Callable[[str], Awaitable[object]],
        prefix: str = DEFAULT_PREFIX,
    ):
        self.store = RequestStore(connect(redis_url), prefix=prefix)
        self.on_cancel = on_cancel
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cancel-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check(self, request_id: str) -> None:
        """Raise RequestCancelled if the request's cancellation is already recorded. Redis being
        unreachable never blocks a request: the gRPC cancellation still reaches this worker."""
        try:
            cancelled = await self.store.is_cancelled(request_id)
        except StateStoreError as exc:
            logger.warning("[%s] cancellation flag unreadable: %s", request_id, exc)
            return
        if cancelled:
            raise RequestCancelled(f"request {request_id} was cancelled")

    async def _run(self) -> None:
        while True:
            try:
                async with self.store.listen_cancellations() as cancelled:
                    async for request_id in cancelled:
                        await self.on_cancel(request_id)
            except StateStoreError as exc:
                logger.warning("cancellation channel lost, resubscribing: %s", exc)
                await asyncio.sleep(1.0)


class NoCancelWatch(_CheckSoon):
    """Stand-in when the worker runs without Redis: only gRPC cancellation applies."""

    async def check(self, request_id: str) -> None:
        return None

    async def stop(self) -> None:
        return None
