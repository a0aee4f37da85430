"""The prefill and decode workers a gateway can reach: the live list from the registry, the pick
for a request, and one gRPC channel per worker.

A channel lives as long as its worker is registered. Each refresh of the list retires the
channels of workers that left it (scaled down, crashed, drained), and a channel that failed a
call with UNAVAILABLE is retired too (the next call dials afresh). A retired channel closes once
no call uses it: a draining worker's streams run to their end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.backend import BackendError
from pdserve.cluster.grpc_server import open_channel
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.routing import pick_decode, pick_prefill
from pdserve.cluster.tls import PLAINTEXT, TLSConfig


@dataclass
class _Channel:
    channel: grpc.aio.Channel
    users: int = 0  # calls using it now
    retired: bool = False  # out of the pool: closes when its last user is done


class WorkerPool:
    def __init__(self, registry: Any, tls: TLSConfig = PLAINTEXT) -> None:
        self.registry = registry  # pdserve.cluster.registry.WorkerRegistry
        self.tls = tls
        self._channels: dict[str, _Channel] = {}

    async def list(self, role: str | None = None, lost: set[str] | None = None
                   ) -> list[WorkerInfo]:
        """Registered workers (of `role`; not those at addresses in `lost`). Retires the channels
        of workers no longer registered. BackendError (retryable) when Redis is unreachable."""
        try:
            workers = await self.registry.list_workers(None)
        except Exception as exc:  # noqa: BLE001
            raise BackendError(f"worker registry unreachable: {exc}", retryable=True) from exc
        live = {w.address for w in workers}
        for address in [a for a in self._channels if a not in live]:
            await self.retire(address)
        return [w for w in workers
                if (role is None or w.role == role) and w.address not in (lost or ())]

    async def route(self, local: bool, lost: set[str]) -> tuple[WorkerInfo, WorkerInfo | None]:
        """The decode worker for a request (most free KV blocks) and, unless it prefills
        locally, its prefill worker (shortest queue), avoiding `lost` workers."""
        workers = await self.list(lost=lost)
        decode = pick_decode(workers)
        if decode is None:
            raise BackendError("no decode worker is available", retryable=True)
        if local:
            return decode, None
        prefill = pick_prefill(workers)
        if prefill is None:
            raise BackendError("no prefill worker is available", retryable=True)
        return decode, prefill

    @asynccontextmanager
    async def channel(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to `address` (opened on first use), held for the calls in the block."""
        entry = self._channels.get(address)
        if entry is None:
            entry = self._channels[address] = _Channel(open_channel(address, self.tls))
        entry.users += 1
        try:
            yield entry.channel
        finally:
            entry.users -= 1
            if entry.retired and entry.users == 0:
                await entry.channel.close()

    async def retire(self, address: str) -> None:
        """Take `address`'s channel out of the pool; close it now if no call uses it."""
        entry = self._channels.pop(address, None)
        if entry is None:
            return
        entry.retired = True
        if entry.users == 0:
            await entry.channel.close()

    def open_addresses(self) -> set[str]:
        """Addresses with a channel in the pool."""
        return set(self._channels)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.retire(address)
