"""The `nixl` data plane: NIXL agents (UCX underneath: shared memory or TCP on one host, RDMA
across hosts; host DRAM on CPU, VRAM on CUDA) WRITE a request's blocks into the peer's pool.

Each worker registers its whole pool once (one allocation, engine/model_runner.py) with its own
agent; the decode worker's agent metadata and pool address travel in DescribeKV, and the
prefill worker adds that agent once per pool. A slab is one transfer request of as few
descriptors as the block runs allow (`descriptors.py`); NIXL's UCX backend flushes the
endpoint before it reports DONE, so the bytes are in the peer's memory when `write` returns.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from functools import cache
from types import ModuleType
from typing import Any

import torch

from engine.kv_transfer import pool_layout
from pdserve.transport.base import NIXL, Peer, PeerUnreachable, PoolInfo
from pdserve.transport.descriptors import block_runs, run_descriptors

_POLL_SPIN = 64  # state checks before sleeping between them


@cache
def nixl_module() -> ModuleType | None:
    """NIXL's Python API: the `nixl` meta package or a CUDA-flavoured wheel; None if absent."""
    for name in ("nixl._api", "nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


class NixlPlane:
    name = NIXL

    def __init__(self, pool: torch.Tensor, agent_name: str, serve: bool = False):
        mod = nixl_module()
        if mod is None:
            raise RuntimeError("the nixl KV transport needs NIXL: pip install 'pdserve[nixl]'")
        self.pool = pool  # [L, 2, N, block_size, Hkv, D], one allocation
        self.layout = pool_layout(pool)
        self.half = self.layout.cell_bytes() // 2  # K (or V) of one block in one layer
        self.mem = "VRAM" if pool.device.type == "cuda" else "DRAM"
        self.device_id = pool.device.index or 0
        # Only the side written into keeps NIXL's progress thread (peers' writes need it to
        # complete; it polls, holding a core): a writer progresses while it waits for its own.
        config = mod.nixl_agent_config(enable_prog_thread=serve, backends=["UCX"])
        self.agent = mod.nixl_agent(agent_name, config)
        self.agent.register_memory(pool)
        self._lock = threading.Lock()  # the agent is built without thread sync

    def export(self) -> dict[str, Any]:
        return {"nixl_metadata": self.agent.get_agent_metadata(),
                "nixl_pool_address": self.pool.data_ptr(), "nixl_device_id": self.device_id}

    def open_peer(self, info: PoolInfo) -> Peer:
        if not info.nixl_metadata:
            raise PeerUnreachable(f"KV pool {info.pool_id} offers no NIXL agent")
        if info.layout != self.layout:
            raise PeerUnreachable(f"KV pool {info.pool_id} has layout {info.layout}, "
                                  f"this worker {self.layout}")
        with self._lock:
            try:
                name = self.agent.add_remote_agent(info.nixl_metadata)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own types
                raise PeerUnreachable(f"NIXL could not add agent of pool {info.pool_id}: "
                                      f"{exc}") from exc
        mem = "VRAM" if info.device_type == "cuda" else "DRAM"
        return Peer(info, NIXL, name, {"mem": mem})

    def write(self, peer: Peer, layers: tuple[int, int], src_ids: list[int],
              dst_ids: list[int], ready: Any = None) -> int:
        if ready is not None:
            ready.synchronize()  # the layers that wrote these blocks
        src0, dst0, lengths = block_runs(src_ids, dst_ids)
        local = run_descriptors(self.pool.data_ptr(), self.pool.shape[2], self.half, layers,
                                src0, lengths, self.device_id)
        info = peer.info
        remote = run_descriptors(info.nixl_pool_address, info.num_blocks, self.half, layers,
                                 dst0, lengths, info.nixl_device_id)
        with self._lock:
            self._transfer(peer, local, remote)
        return int(lengths.sum()) * 2 * (layers[1] - layers[0]) * self.half

    def _transfer(self, peer: Peer, local: Any, remote: Any) -> None:
        """One WRITE of `local` descriptors into `remote` ones, waited for."""
        agent = self.agent
        try:
            handle = agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs(local, self.mem),
                agent.get_xfer_descs(remote, peer.extra["mem"]), peer.handle)
        except Exception as exc:  # noqa: BLE001
            raise ConnectionError(f"NIXL could not prepare the KV write: {exc}") from exc
        try:
            state, polls = agent.transfer(handle), 0
            while state == "PROC":
                polls += 1
                if polls > _POLL_SPIN:
                    time.sleep(50e-6)
                state = agent.check_xfer_state(handle)
        except Exception as exc:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError: peer gone
            raise ConnectionError(f"NIXL KV write to pool {peer.info.pool_id} failed: "
                                  f"{exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)
        if state != "DONE":
            raise ConnectionError(f"NIXL KV write to pool {peer.info.pool_id} failed")

    def close_peer(self, peer: Peer) -> None:
        with self._lock, contextlib.suppress(Exception):  # a gone peer may fail to go
            self.agent.remove_remote_agent(peer.handle)

    def close(self) -> None:
        with self._lock, contextlib.suppress(Exception):
            self.agent.deregister_memory(self.agent.get_reg_descs(self.pool))
