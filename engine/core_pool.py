"""An engine core process's KV pool, mapped in its server's process too.

A role's engine core (decode_svc/engine_core.py, prefill_svc/engine_core.py) allocates the pool;
the server next to it reads or writes blocks there (a grpc push's slabs: the decode worker
scatters them in, the prefill worker gathers them out; a prefill worker's data-plane writes
read it). The core describes the pool in its facts (`pool_spec`) and the server maps it:

    CPU   ("memfd", shape, dtype)       the pool lives in a memfd (EngineConfig's
                                        `cache.shared_pool`); the core sends the fd over the
                                        socket right after "ready" (`send_pool_fd`), the server
                                        maps it before reading anything else (`MappedPool`)
    CUDA  ("cuda", (rebuild, args))     torch's CUDA IPC reduction of the pool; the server
                                        opens it at its first use (a handle opens once per
                                        process)

The mapping outlives the core: a server whose core died still holds valid memory.

`PoolCore` and `PoolCoreClient` are both sides of such a role: one rank (tensor parallelism
refused: only that rank's pool would be mapped), the pool allocated to be shared, described in
the facts and mapped, and the prefix cache's events on request (KV-aware routing).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from typing import Any

import torch

from engine import zero_pages
from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.core_process import Core, CoreFacts
from engine.kv_events import KVEventBatch, prefix_events
from engine.llm_engine import LLMEngine


def pool_spec(pool: torch.Tensor) -> tuple:
    """How a server maps `pool` (the facts' `pool` field)."""
    if pool.device.type == "cpu":
        return ("memfd", tuple(pool.shape), str(pool.dtype).removeprefix("torch."))
    from torch.multiprocessing.reductions import reduce_tensor

    return ("cuda", reduce_tensor(pool))


def send_pool_fd(runner: Any, conn: Connection, spec: tuple) -> None:
    """In the core, right after "ready": a CPU pool's memfd to the server (then closed here;
    the mapping stays). Nothing for a CUDA pool."""
    fd = getattr(runner, "kv_pool_fd", None)
    if spec[0] != "memfd" or fd is None:
        return
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sendfds(sock, [fd])
    os.close(fd)
    runner.kv_pool_fd = None


class MappedPool:
    """The server's side: built before anything else is read from `conn` (a CPU pool's fd is
    the next message), the tensor opened at the first `tensor()` for a CUDA pool."""

    def __init__(self, conn: Connection, spec: tuple) -> None:
        self.spec = spec
        self._pool: torch.Tensor | None = None
        self._lock = threading.Lock()
        if spec[0] == "memfd":
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                fd = recvfds(sock, 1)[0]
            try:
                _, shape, dtype = spec
                self._pool = zero_pages.map_shared(fd, shape, getattr(torch, dtype))
            finally:
                os.close(fd)

    @property
    def opened(self) -> torch.Tensor | None:
        """The pool if mapped already (no CUDA handle opened for asking)."""
        return self._pool

    def tensor(self) -> torch.Tensor:
        """The pool, [L, 2, N, block_size, Hkv, D] (a CUDA pool opened now if not yet)."""
        with self._lock:
            if self._pool is None:
                rebuild, args = self.spec[1]
                self._pool = rebuild(*args)
        return self._pool


@dataclasses.dataclass(frozen=True)
class PoolFacts(CoreFacts):
    pool: tuple = ()  # how the server maps the pool (`pool_spec`)


class PoolCore(Core):
    """The child's side of a role whose server maps the engine's pool (decode_svc/engine_core.py,
    prefill_svc/engine_core.py). `ROLE` names it in errors; `pool_facts` builds its facts."""

    ROLE = ""

    def __init__(self, engine: LLMEngine, conn: Connection, listener: Any = None,
                 options: dict | None = None) -> None:
        super().__init__(engine, conn, listener, options)
        self.handlers["prefix_events"] = self._prefix_events

    @classmethod
    def engine_config(cls, model: str | None, kwargs: dict, options: dict) -> EngineConfig:
        config = Core.engine_config(model, kwargs, options)
        if config.parallel.tensor_parallel_size > 1:  # PoolCoreClient says so first
            raise ValueError(f"tensor_parallel_size: a {cls.ROLE} engine core process runs one "
                             "rank")
        return dataclasses.replace(config,
                                   cache=dataclasses.replace(config.cache, shared_pool=True))

    def pool_facts(self, facts_class: type[PoolFacts], **extra: Any) -> PoolFacts:
        """`Core`'s facts as `facts_class`, with the pool's spec and the role's `extra`."""
        base = {f.name: getattr(self.facts, f.name) for f in dataclasses.fields(CoreFacts)}
        return facts_class(**base, pool=pool_spec(self.engine.runner.kv_pool), **extra)

    def started(self) -> None:
        """The CPU pool's memfd to the parent, right after "ready" (it reads it there)."""
        send_pool_fd(self.engine.runner, self.parent, self.facts.pool)

    def _prefix_events(self, full: bool) -> KVEventBatch:
        return prefix_events(self.engine.block_manager, full)


class PoolCoreClient(EngineCoreClient):
    """The server's side: the pool mapped here (`pool`), tensor parallelism refused before a
    process starts, `prefix_events`."""

    @classmethod
    def from_args(cls, model: str | None = None, listen: str = "", options: dict | None = None,
                  **kwargs: Any) -> Any:
        """`EngineCoreClient.from_args` for the role; ValueError at once for tensor
        parallelism."""
        if kwargs.get("tensor_parallel_size", 1) > 1:
            raise ValueError(f"tensor_parallel_size: a {cls.ROLES[0]} worker's engine core "
                             "process runs one rank (its server maps that rank's KV pool); use "
                             "--engine-core thread with tensor parallelism")
        return super().from_args(model, listen, options, **kwargs)

    def __init__(self, conn: Connection, facts: PoolFacts, proc: Any = None) -> None:
        self.facts = facts
        self.pool = MappedPool(conn, facts.pool)  # sent right after "ready", if a memfd
        super().__init__(conn, facts, proc)

    async def prefix_events(self, full: bool) -> KVEventBatch:
        return await self._call("prefix_events", full)
