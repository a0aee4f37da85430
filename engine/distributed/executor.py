"""Rank 0's side of a tensor-parallel worker: start the other ranks, watch them, stop them.

Ranks 1..N-1 are spawned processes running `engine.distributed.rank_main.run_rank`; rank 0 is
the engine's own process (scheduler, block manager, sampling, detokenizing). The ranks meet on
a TCP store that rank 0 opens on a free port. A watcher thread waits on the processes: when one
exits, `on_failure` hears of it at once (the engine fails its requests even while idle), and
the next collective fails too (gloo drops the connection; NCCL times out).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - registers tensor sharing for the pipes

from engine.config import EngineConfig
from engine.distributed import step_channel
from engine.distributed.group import TPGroup
from engine.input_batch import HostStep
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, or a collective failed."""


class TPExecutor:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        from engine.distributed.rank_main import run_rank

        par = config.parallel
        self.world_size = par.tensor_parallel_size
        timeout = datetime.timedelta(seconds=par.timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, True, timeout=timeout,
                              wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        # one pipe per rank: steps to it (step_channel.py), its KV pool back (kv_shards.py)
        pipes = [ctx.Pipe() for _ in range(1, self.world_size)]
        self.conns = [ours for ours, _ in pipes]
        self.procs = [
            ctx.Process(target=run_rank, args=(config, rank, store.port, theirs),
                        name=f"pdserve-tp-rank{rank}", daemon=True)
            for rank, (_, theirs) in enumerate(pipes, start=1)
        ]
        for p in self.procs:
            p.start()
        self._failure: RankFailure | None = None
        self._on_failure: Callable[[RankFailure], None] | None = None
        self._stopping = False
        self.group = TPGroup(0, self.world_size, store, device, par.timeout_s,
                             par.enable_expert_parallel)
        threading.Thread(target=self._watch, name="pdserve-tp-watch", daemon=True).start()
        self._finalizer = weakref.finalize(self, _stop, self.group, self.conns, self.procs)

    def on_failure(self, callback: Callable[[RankFailure], None]) -> None:
        """Call `callback` (from the watcher thread) when a rank exits while serving."""
        self._on_failure = callback
        if self._failure is not None:
            callback(self._failure)

    def failure(self, cause: BaseException | None = None) -> RankFailure:
        """The error that names what went wrong: a dead rank if one died, else `cause`."""
        if self._failure is not None:
            return self._failure
        return RankFailure(f"tensor-parallel collective failed: {cause}")

    def peer_pools(self, timeout_s: float) -> list[torch.Tensor]:
        """The KV pools of ranks 1..N-1, mapped into this process (shared memory or CUDA IPC;
        each rank sends its own once it has allocated it)."""
        pools = []
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout_s):
                raise RankFailure(f"tensor-parallel rank {rank} did not share its KV pool")
            pools.append(conn.recv())
        return pools

    def send_step(self, host: HostStep) -> None:
        step_channel.send_step(self.conns, host)

    def send_lora(self, slot: int, request: LoRARequest) -> None:
        step_channel.send_lora(self.conns, slot, request)

    def stop(self) -> None:
        """Tell the ranks to exit and wait for them (killing any that do not)."""
        self._stopping = True
        self._finalizer()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = wait(list(sentinels))
        proc = sentinels[ready[0]]
        proc.join(timeout=5)  # reap it: its exit code
        if self._stopping or proc.exitcode == 0:  # told to stop
            return
        self._failure = RankFailure(
            f"tensor-parallel rank {proc.name.rsplit('rank', 1)[1]} exited with code "
            f"{proc.exitcode}"
        )
        logger.error("%s", self._failure)
        if self._on_failure is not None:
            self._on_failure(self._failure)


def _stop(group: TPGroup, conns: list[Connection], procs: list[multiprocessing.Process]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # that rank is gone
            step_channel.send_stop([conn])
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    group.close()
