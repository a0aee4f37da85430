"""KV leases: a prefill worker holds a prefilled request's blocks for a bounded time only.

NOTE: after its prefill, a request's KV blocks stay held on the prefill worker until the decode
worker has taken them (the PushKV reply), so that they can be shipped. A decode worker that
never claims them (it hangs mid-push, is cut off by a partition, or a lost race left the
request held with no push at all) would strand them for ever. Every held request is therefore
on a lease: a sweep every `interval_s` finds the requests held for longer than `lease_s` (since
the sweep first saw them), ends each one's push if it still runs, frees its blocks and counts
it (`TransferStats.lease_expired`, exported as `pdserve:kv_lease_expired_total`).

    prefilled ──held──▶ push acknowledged ──▶ released               (the normal path)
                  └───── lease runs out ────▶ push cancelled, released, counted
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from engine.async_engine import AsyncLLMEngine
from pdserve.cluster.worker import TransferStats
from prefill_svc.core_client import PrefillCoreClient

logger = logging.getLogger(__name__)


class KVLeases:
    def __init__(
        self, engine: AsyncLLMEngine | PrefillCoreClient, lease_s: float,
        expire: Callable[[str], Awaitable[bool]], stats: TransferStats,
        interval_s: float | None = None,
    ):
        """`expire(request_id)` ends the request's push and frees its blocks; True if it held
        any. `interval_s` defaults to a quarter of the lease, at most one second."""
        if not lease_s > 0:
            raise ValueError(f"the KV lease must be > 0 seconds, got {lease_s}")
        self.engine = engine
        self.lease_s = lease_s
        self.expire = expire
        self.stats = stats
        self.interval_s = interval_s or min(1.0, lease_s / 4)
        self._since: dict[str, float] = {}  # held request id -> when a sweep first saw it
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-leases")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def sweep(self) -> list[str]:
        """Expire every request held past its lease; returns their ids."""
        now = time.monotonic()
        held = await self.engine.held_requests()
        self._since = {rid: self._since.get(rid, now) for rid in held}
        expired = [rid for rid, since in self._since.items() if now - since >= self.lease_s]
        for rid in expired:
            if await self.expire(rid):
                self.stats.lease_expired += 1
                logger.warning("[%s] KV lease of %g s expired: blocks freed unclaimed", rid,
                               self.lease_s)
            self._since.pop(rid, None)
        return expired

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep is retried at the next tick
                logger.exception("KV lease sweep failed")

