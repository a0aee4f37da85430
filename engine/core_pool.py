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
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from typing import Any

import torch

from engine import zero_pages


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
