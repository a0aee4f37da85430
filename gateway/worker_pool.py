"""The prefill and decode workers a gateway can reach: the live list from the registry, the pick
for a request, and one gRPC channel per worker.

A channel lives as long as its worker is registered. Each refresh of the list retires the
channels of workers that left it (scaled down, crashed, drained), and a channel that failed a
call with UNAVAILABLE is retired too (the next call dials afresh). A retired channel closes once
no call uses it: a draining worker's streams run to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from engine.block_manager import prefix_hashes
from gateway.backend import BackendError
from pdserve.cluster.grpc_server import open_channel
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.routing import ROUTING, pick_decode, pick_prefill, pick_round_robin
from pdserve.cluster.tls import PLAINTEXT, TLSConfig


@dataclass
class _Channel:
    channel: grpc.aio.Channel
    users: int = 0  # calls using it now
    retired: bool = False  # out of the pool: closes when its last user is done


class PrefillClaim:
    """One request counted against a prefill worker's address until `release()` (idempotent;
    also on leaving `async with`)."""

    def __init__(self, claims: dict[str, int], address: str | None) -> None:
        self._claims, self._address = claims, address
        if address is not None:
            claims[address] = claims.get(address, 0) + 1

    def release(self) -> None:
        if self._address is not None:
            self._claims[self._address] -= 1
            self._address = None

    async def __aenter__(self) -> PrefillClaim:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class WorkerPool:
    def __init__(self, registry: Any, tls: TLSConfig = PLAINTEXT, routing: str = "kv_aware",
                 prefixes: PrefixIndex | None = None, metrics: Any = None,
                 rng: random.Random | None = None, list_max_age_s: float = 0.1,
                 list_stale_s: float = 2.0) -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
        self.registry = registry  # pdserve.cluster.registry.WorkerRegistry
        self.tls = tls
        self.routing = routing
        self.prefixes = prefixes  # kv_aware: the workers' cached prefix blocks
        self.decisions: dict[str, int] = {}  # "role:reason" -> count
        self.metrics = metrics  # gateway.metrics.GatewayMetrics: routing_decisions
        self.rng = rng or random.Random()  # ties between workers (pdserve/cluster/routing.py)
        self._turn = 0
        self._channels: dict[str, _Channel] = {}
        self._claims: dict[str, int] = {}  # prefill address -> requests routed there, unfinished
        # routing's registry read (`_recent`): every list_max_age_s in the background, on a
        # request's way where it is list_stale_s old (0, 0: on every request's way)
        self.list_max_age_s, self.list_stale_s = list_max_age_s, list_stale_s
        self._listed: tuple[float, list[WorkerInfo]] | None = None  # (when, workers)
        self._listing: asyncio.Future[list[WorkerInfo]] | None = None
        self._refresher: asyncio.Task | None = None

    async def list(self, role: str | None = None, lost: set[str] | None = None
                   ) -> list[WorkerInfo]:
        """Registered workers (of `role`; not those at addresses in `lost`). Retires the channels
        of workers no longer registered. BackendError (retryable) when Redis is unreachable."""
        try:
            workers = await self.registry.list_workers(None)
        except Exception as exc:  # noqa: BLE001
            self._listed = None  # routing fails too, until the registry is back
            raise BackendError(f"worker registry unreachable: {exc}", retryable=True) from exc
        self._listed = (time.monotonic(), workers)  # routing's (`_recent`)
        live = {w.address for w in workers}
        for address in [a for a in self._channels if a not in live]:
            await self.retire(address)
        return [w for w in workers
                if (role is None or w.role == role) and w.address not in (lost or ())]

    async def route(
        self, local: bool, lost: set[str], token_ids: list[int] | None = None,
        lora: str | None = None,
    ) -> tuple[WorkerInfo, WorkerInfo | None]:
        """The decode worker for a request and, unless it prefills locally, its prefill worker,
        avoiding `lost` workers, by the `routing` policy (pdserve/cluster/routing.py; kv_aware
        scores prefill workers by the prompt's (`token_ids`) blocks they hold, hashed under the
        request's LoRA adapter `lora` as the workers hash them; kv_aware and load favour
        workers holding `lora`)."""
        workers = [w for w in await self._recent() if w.address not in lost]
        roles = ("decode",) + (() if local else ("prefill",))
        if not all(any(w.role == role for w in workers) for role in roles):
            workers = await self.list(lost=lost)  # none of a role: one may have just come
        self._turn += 1
        choice = any(sum(w.role == role for w in workers) > 1 for role in roles)
        if self.routing == "round_robin":
            decode = pick_round_robin(workers, "decode", self._turn)
            prefill = None if local else pick_round_robin(workers, "prefill", self._turn)
            reasons = ("round_robin", "round_robin")
        else:  # the prefix index read only where there is a choice to make
            hits, blocks = await self._hits(workers, token_ids, lora) if choice else ({}, 0)
            decode = pick_decode(workers, hits, blocks, lora, self.rng)
            prefill = None if local else pick_prefill(workers, hits, blocks, lora,
                                                      self.in_flight(), self.rng)
            reasons = (_reason(decode, hits, lora), _reason(prefill, hits, lora))
        if not choice:
            reasons = ("only", "only")
        if decode is None:
            raise BackendError("no decode worker is available", retryable=True)
        self._count("decode", reasons[0])
        if local:
            return decode, None
        if prefill is None:
            raise BackendError("no prefill worker is available", retryable=True)
        self._count("prefill", reasons[1])
        return decode, prefill

    async def _recent(self) -> list[WorkerInfo]:
        """The registered workers as `list()` last read them, read again every
        `list_max_age_s` by a task of the pool's; awaited here only where that read is
        `list_stale_s` old (or there is none yet), one read at a time.

        NOTE: why. Routing read the registry (two Redis round trips) on every request's way to
        its first token, 1.6 ms of a split request's 22.5 at 16 req/s on an H100 (`python -m
        pdserve.bench.ttft_breakdown`, 2026-12-06). The entries' load numbers are a heartbeat
        old anyway (1 s); what a request routed meanwhile needs, this gateway's own requests
        in flight, is counted here (`in_flight`); a worker that deregistered (draining) is
        out of the list a tenth of a second later, and one gone without a word is routed
        around as on any failed call (the request's `lost`). Every `list()` (readiness,
        retries) renews it; one that fails drops it: with the registry unreachable, requests
        fail (503) as the gateway's readiness says."""
        if self._refresher is None and self.list_max_age_s > 0:
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh(), name="registry-refresh")
        cached = self._listed
        if cached is not None and time.monotonic() - cached[0] <= self.list_stale_s:
            return cached[1]
        if self._listing is None or self._listing.done():
            self._listing = asyncio.ensure_future(self.list())
            self._listing.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._listing)

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.list_max_age_s)
            with contextlib.suppress(BackendError):  # dropped the list: routing says so
                await self.list()

    async def _hits(
        self, workers: list[WorkerInfo], token_ids: list[int] | None, lora: str | None = None,
    ) -> tuple[dict[str, int], int]:
        """kv_aware: per worker, the leading blocks of `token_ids` its prefix cache holds, and
        the prompt's full blocks (the largest count over the workers' block sizes); ({}, 0)
        for the other policies, or when Redis cannot say (routing by load alone)."""
        if self.routing != "kv_aware" or self.prefixes is None or not token_ids:
            return {}, 0
        hits: dict[str, int] = {}
        blocks = 0
        for size in {w.block_size for w in workers if w.block_size > 0}:
            hashes = prefix_hashes(token_ids, size, lora)
            blocks = max(blocks, len(hashes))
            same = [w.worker_id for w in workers if w.block_size == size]
            try:
                hits.update(await self.prefixes.leading_hits(same, hashes))
            except Exception:  # noqa: BLE001 - Redis trouble: route by load alone
                return {}, 0
        return hits, blocks

    def _count(self, role: str, reason: str) -> None:
        key = f"{role}:{reason}"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.routing_decisions.labels(role=role, reason=reason).inc()

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

    def in_flight(self) -> dict[str, int]:
        """This gateway's requests in their prefill phase per prefill worker address (`claim`):
        current, where the registry's load is a heartbeat old. Counted from the routing
        decision, not from the Prefill call: between the two the decode worker reserves the
        blocks, and requests routed meanwhile must see the ones before them."""
        return {address: n for address, n in self._claims.items() if n}

    def claim(self, worker: WorkerInfo | None) -> PrefillClaim:
        """Count a request routed to the prefill `worker` in `in_flight` until the claim's
        `release()` (its first token, or its failure); None: a claim on nothing."""
        return PrefillClaim(self._claims, None if worker is None else worker.address)

    def open_addresses(self) -> set[str]:
        """Addresses with a channel in the pool."""
        return set(self._channels)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        for address in list(self._channels):
            await self.retire(address)


def _reason(chosen: WorkerInfo | None, hits: dict[str, int], lora: str | None = None) -> str:
    """Why `chosen` was picked, for the routing metrics: its cached prefix, the request's LoRA
    adapter it holds, or its load (`route` says "only" where no role had a choice)."""
    if chosen is not None and hits.get(chosen.worker_id, 0) > 0:
        return "prefix_hit"
    if chosen is not None and lora is not None and lora in chosen.lora_adapters:
        return "lora_hit"
    return "load"
