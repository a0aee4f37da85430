"""Worker registry in Redis: each worker's address and load, kept alive by a heartbeat TTL.

A worker writes its ``WorkerInfo`` as JSON under ``{p}:worker:{role}:{worker_id}`` with a TTL of
``WorkerRegistry.ttl_s``; one that stops heartbeating (crash, partition) drops out of
``list_workers`` within that TTL, with nobody cleaning up after it.

NOTE: listing reads the index ``{p}:workers``, a sorted set of the entries' keys (scored by when
the writer expects them to expire), then the entries themselves (MGET; an expired one reads as
nothing): two round trips whatever else the namespace holds. A SCAN for the key pattern read
the whole keyspace, and every request leaves ~4 keys behind for up to an hour (its state,
its resumable stream's events): at 23k keys a listing took 20 ms, and the gateway lists on
every request it routes. Each write also drops index members whose entries expired more than
``PRUNE_AFTER_S`` ago by the writer's clock (slack for clocks of other hosts). A namespace
without an index (workers of an earlier version only) is listed by SCAN as before; a worker
of an earlier version beside ones that write the index is not listed by a gateway of this one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis

from pdserve.cluster.state import DEFAULT_PREFIX, Keys, StateStoreError, wrap_redis_errors

logger = logging.getLogger(__name__)

ROLES = ("tokenizer", "prefill", "decode", "gateway")
MIN_BEATS_PER_TTL = 3  # heartbeats per TTL: an entry survives two missed beats
PRUNE_AFTER_S = 60.0  # index members of entries expired this long ago are dropped
# What a worker of this version offers beyond what every version does, listed in its entry
# (`WorkerInfo.features`): a gateway asks it of a worker listing it only, so workers of an
# earlier version keep working beside newer gateways during a rolling upgrade.
PREFILL_BESIDE_RESERVATION = "prefill_beside_reservation"  # PrefillRequest's
# decode_reservation_pending and the Reserved rpc
FEATURES = {"prefill": [PREFILL_BESIDE_RESERVATION]}  # per role


@dataclass
class WorkerInfo:
    """One worker's identity and load, as published in the registry."""

    worker_id: str
    role: str  # one of ROLES
    address: str  # host:port of its gRPC (or HTTP, for gateways) server
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    metrics_address: str = ""
    kv_transport: str = ""  # the worker's --kv-transport; "" for tokenizers, gateways, old workers
    tensor_parallel_size: int = 0  # the worker's --tensor-parallel-size; 0 as for kv_transport
    block_size: int = 0  # tokens per KV block (the prefix hashes' unit); 0 as for kv_transport
    num_cached_blocks: int = 0  # blocks in its prefix cache (what KV-aware routing can hit)
    # LoRA adapters in its host cache (routing prefers a worker holding a request's adapter)
    lora_adapters: list[str] = field(default_factory=list)
    features: list[str] = field(default_factory=list)  # its role's FEATURES; [] for old workers
    updated_at: float = 0.0  # time.time() of the last registry write

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id or any(c in self.worker_id for c in "*?[]"):
            raise ValueError(f"worker_id must be non-empty without glob characters: "
                             f"{self.worker_id!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WorkerInfo:
        """Parse ``to_json`` output; unknown keys (from a newer worker) are ignored."""
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class WorkerRegistry:
    """Register, heartbeat, deregister and list workers of one cluster."""

    def __init__(self, client: Redis, prefix: str = DEFAULT_PREFIX, ttl_s: float = 5.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client = client
        self.keys = Keys(prefix)
        self.ttl_s = ttl_s

    @wrap_redis_errors
    async def register(self, info: WorkerInfo) -> WorkerInfo:
        """Write ``info`` (stamped with ``updated_at`` = now) with a TTL of ``ttl_s``, replacing
        any previous entry. Returns the stamped copy; ``info`` itself is not modified."""
        stamped = dataclasses.replace(info, updated_at=time.time())
        key, index = self.keys.worker(info.role, info.worker_id), self.keys.worker_index()
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(key, stamped.to_json(), px=max(1, int(self.ttl_s * 1000)))
            pipe.zadd(index, {key: stamped.updated_at + self.ttl_s})
            pipe.zremrangebyscore(index, "-inf", stamped.updated_at - PRUNE_AFTER_S)
            await pipe.execute()
        return stamped

    async def heartbeat(self, info: WorkerInfo) -> WorkerInfo:
        """Same as ``register``: refresh the entry, its load numbers and its TTL."""
        return await self.register(info)

    @wrap_redis_errors
    async def deregister(self, role: str, worker_id: str) -> None:
        """Delete the worker's entry at once (no-op if it already expired)."""
        key = self.keys.worker(role, worker_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.zrem(self.keys.worker_index(), key)
            await pipe.execute()

    @wrap_redis_errors
    async def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Live workers (of ``role``, or all), sorted by (role, worker_id), through the index
        (the module's NOTE); entries that expired or fail to parse are skipped. Read only."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        pattern = self.keys.worker_pattern(role)
        index = self.keys.worker_index()
        keys = [k for k in await self.client.zrange(index, 0, -1) if k.startswith(pattern[:-1])]
        if not keys and not await self.client.exists(index):  # workers of an earlier version
            keys = await self.scan_keys(role)
        values = await self.client.mget(keys) if keys else []
        workers = []
        for key, value in zip(keys, values):
            if value is None:
                continue
            try:
                workers.append(WorkerInfo.from_json(value))
            except (ValueError, TypeError) as e:
                logger.warning("skipping malformed registry entry %s: %s", key, e)
        return sorted(workers, key=lambda w: (w.role, w.worker_id))

    async def scan_keys(self, role: str | None = None) -> list[str]:
        """The entries' keys (of ``role``) found by SCAN: every key of the keyspace is read."""
        pattern = self.keys.worker_pattern(role)
        return [k async for k in self.client.scan_iter(match=pattern, count=200)]


class Heartbeat:
    """Keeps a worker's registry entry alive from an asyncio task.

    Every ``interval_s`` it writes the worker's info, refreshed by ``get_info()`` (load numbers).
    NOTE: ``get_info`` may be slow: a worker's asks its engine, which answers between steps, and
    a long step on a loaded CPU takes seconds. The write never waits on it past
    ``interval_s / 2``: the entry is then refreshed with the last info, and the pending
    ``get_info`` is awaited again on the next beat (never started twice). So a busy worker stays
    registered (TTL ``registry.ttl_s``, at least 3 intervals) with load numbers a beat or two old.

    NOTE: ``after_beat`` (the prefix cache's events into Redis) also asks the engine, and may
    take as long as a step, so it runs in a task of its own, started after a beat reached the
    registry when none is still running: the beats never wait on it. Awaited inline, a worker
    whose steps took seconds under overload could miss its TTL and drop out of the registry
    while serving (the gateway then answers 503, "no prefill worker is available").

    Failures (Redis down, ``get_info`` or ``after_beat`` raising) are logged once per outage and
    retried on the next tick; they never end the task. ``stop()`` ends it and deregisters the
    worker.
    """

    def __init__(self, registry: WorkerRegistry, get_info: Callable[[], Awaitable[WorkerInfo]],
                 interval_s: float = 1.0,
                 after_beat: Callable[[WorkerInfo], Awaitable[None]] | None = None) -> None:
        if not 0 < interval_s <= registry.ttl_s / MIN_BEATS_PER_TTL:
            raise ValueError(f"need 0 < interval_s <= registry ttl_s / {MIN_BEATS_PER_TTL} "
                             f"({registry.ttl_s} / {MIN_BEATS_PER_TTL}), got {interval_s}")
        self.registry = registry
        self.get_info = get_info
        self.interval_s = interval_s
        self.after_beat = after_beat  # run after each beat that reached the registry
        self.last_info: WorkerInfo | None = None  # last info obtained from get_info
        self._healthy = True
        self._task: asyncio.Task[None] | None = None
        self._pending: asyncio.Future[WorkerInfo] | None = None  # a get_info still running
        self._after: asyncio.Task[None] | None = None  # an after_beat still running
        self._after_healthy = True

    @property
    def running(self) -> bool:
        """Whether the heartbeat task is alive."""
        return self._task is not None and not self._task.done()

    async def beat(self) -> bool:
        """One heartbeat now. Returns whether it reached the registry; never raises. Starts
        ``after_beat`` in the background when it reached it and no earlier one still runs."""
        try:
            info = await self.registry.heartbeat(await self._info())
        except Exception as e:
            if self._healthy:
                logger.warning("heartbeat failed, will keep retrying: %s", e)
            self._healthy = False
            return False
        if not self._healthy:
            logger.info("heartbeat recovered")
        self._healthy = True
        if self.after_beat is not None and (self._after is None or self._after.done()):
            self._after = asyncio.ensure_future(self._run_after_beat(info))
        return True

    async def _run_after_beat(self, info: WorkerInfo) -> None:
        try:
            await self.after_beat(info)
        except Exception as e:
            if self._after_healthy:
                logger.warning("after-heartbeat publish failed, will keep retrying: %s", e)
            self._after_healthy = False
            return
        if not self._after_healthy:
            logger.info("after-heartbeat publish recovered")
        self._after_healthy = True

    async def _info(self) -> WorkerInfo:
        """Fresh info if ``get_info`` answers within half an interval, else the last info."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.get_info())
        done, _ = await asyncio.wait({self._pending}, timeout=self.interval_s / 2)
        if done:
            pending, self._pending = self._pending, None
            self.last_info = pending.result()
        elif self.last_info is None:
            raise TimeoutError("no worker info yet: get_info has not answered")
        else:
            logger.debug("get_info is slow: heartbeat with the last load numbers")
        return self.last_info

    def start(self) -> None:
        """Start the heartbeat task (first beat at once). Needs a running event loop."""
        if self._task is not None:
            raise RuntimeError("heartbeat already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        """Stop the task, then deregister the worker (best effort: errors are logged)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task})  # unlike `await task`, never swallows our own cancellation
        for running in (self._pending, self._after):
            if running is not None:
                running.cancel()
        self._pending = self._after = None
        if self.last_info is not None:
            try:
                await self.registry.deregister(self.last_info.role, self.last_info.worker_id)
            except StateStoreError as e:
                logger.warning("deregister failed (entry expires in %.1fs): %s",
                               self.registry.ttl_s, e)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.beat()
            # A fixed period: a slow beat (Redis timing out) does not push the next one back.
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
