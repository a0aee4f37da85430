"""The collectives one worker's tensor-parallel ranks run together.

A `TPGroup` wraps two torch.distributed process groups built directly on a TCP store, not
through `init_process_group`: no global default group, so several engines (a test's prefill and
decode workers) can live in one process. `device` runs the model's collectives (NCCL on CUDA,
gloo on the CPU); `host` (gloo) settles what the ranks must agree on at start (the KV cache's
block count). Every collective fails with RuntimeError after `timeout_s` or as soon as a
peer's connection drops, so a dead or hung rank fails the step instead of hanging the worker.

`SingleRank` is the group of a worker without tensor parallelism: its collectives cost nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 10.0


def connect(port: int, world_size: int, timeout_s: float) -> dist.Store:
    """A client of rank 0's TCP store on this host."""
    return dist.TCPStore("127.0.0.1", port, world_size, False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class SingleRank:
    rank = 0
    world_size = 1
    expert_parallel = False  # MoE experts whole on ranks instead of sliced (engine/models/moe.py)

    def min_host(self, value: int) -> int:
        return value

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def broadcast_host(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def close(self) -> None:
        pass


class TPGroup(SingleRank):
    def __init__(
        self, rank: int, world_size: int, store: dist.Store, device: torch.device,
        timeout_s: float, expert_parallel: bool = False,
    ) -> None:
        """Join the group (blocks until every rank has, or `timeout_s`). `store`: rank 0's
        TCP store, or a client of it (`connect`)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.expert_parallel = expert_parallel
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = store
        self.host = dist.ProcessGroupGloo(dist.PrefixStore("host/", self._store), rank,
                                          world_size, timeout)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("dev/", self._store), rank,
                                             world_size, opts)
        else:
            self.dev = dist.ProcessGroupGloo(dist.PrefixStore("dev/", self._store), rank,
                                             world_size, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the ranks, in place."""
        self.dev.allreduce([t]).wait()
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' `t` concatenated along the last dim, in rank order. Other ranks:
        their own `t` (they only send)."""
        t = t.contiguous()
        outs = [[torch.empty_like(t) for _ in range(self.world_size)]] if self.rank == 0 else []
        self.dev.gather(outs, [t], dist.GatherOptions()).wait()
        return torch.cat(outs[0], dim=-1) if self.rank == 0 else t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank (device group), in place."""
        self.dev.broadcast(t, 0).wait()
        return t

    def broadcast_host(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor `t` on every rank (host group), in place."""
        self.host.broadcast(t, 0).wait()
        return t

    def min_host(self, value: int) -> int:
        """The smallest of the ranks' `value`s, on every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.host.allreduce([t], opts).wait()
        return int(t.item())

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Abort both process groups, waiting at most `timeout_s` for it: a communicator that
        will not close (a peer gone mid-collective, a CUDA graph still holding it) is left to
        the process's exit rather than hanging the worker's shutdown."""
        def abort() -> None:
            for pg in (self.dev, self.host):
                with contextlib.suppress(RuntimeError):
                    pg.abort()

        closer = threading.Thread(target=abort, name="pdserve-tp-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            logger.warning("tensor-parallel rank %d: its process groups did not close within "
                           "%.0f s; left to the process's exit", self.rank, timeout_s)
