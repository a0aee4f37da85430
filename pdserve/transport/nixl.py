"""The `nixl` data plane: NIXL agents (UCX underneath: shared memory or TCP on one host, RDMA
across hosts; host DRAM on CPU, VRAM on CUDA) WRITE a request's blocks into the peer's pool.

Each worker registers its whole pool once (one allocation, engine/model_runner.py) with its own
agent; the decode worker's agent metadata and pool address travel in DescribeKV, and the
prefill worker adds that agent once per pool. A slab is one transfer request of as few
descriptors as the block runs allow (`descriptors.py`); NIXL's UCX backend flushes the
endpoint before it reports DONE, so the bytes are in the peer's memory when `write` returns.

NOTE: staging. NIXL's cost is per descriptor (measured on an H100: 16k tokens of shuffled blocks,
32,768 descriptors of 16 KiB, 2.3 GiB/s; the same bytes as 32 descriptors, 444 GiB/s). A run
needs consecutive blocks on both sides; a fragmented source pool (a long-running prefill worker)
breaks them where the destination's (blocks a decode worker reserves in order) would not. Then,
on a GPU, the slab is gathered into a registered staging buffer in the destination's order
(kernels/kv_block_copy.py), 256 MiB at a time, and each chunk goes as the destination's runs:

    pool [L, 2, N, ..] --gather src_ids[chunk]--> staging [l, 2, m, ..] --WRITE, one descriptor
                                                                          per dst run x l x 2-->
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np
import torch

from engine.kv_transfer import pool_layout
from pdserve.transport.base import NIXL, Peer, PeerUnreachable, PoolInfo, ready_events
from pdserve.transport.descriptors import block_runs, run_descriptors
from pdserve.transport.nixl_agent import progress_agent

_POLL_SPIN = 64  # state checks before sleeping between them
# the staging buffer, allocated on first use: each chunk is one NIXL transfer (~0.5-0.9 ms of
# fixed cost on an H100 measured with 64 MiB chunks)
STAGE_BYTES = 256 << 20
STAGE_MIN_GAIN = 4  # stage when the source splits runs into this many times the destination's


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

    def __init__(self, pool: torch.Tensor, agent_name: str, serve: bool = False,
                 stage: str = "auto", stage_bytes: int = STAGE_BYTES):
        """`stage`: "auto" (on CUDA, when the source's order splits the runs, see the NOTE),
        "always" or "never"."""
        if stage not in ("auto", "always", "never"):
            raise ValueError(f"stage must be auto, always or never; got {stage!r}")
        mod = nixl_module()
        if mod is None:
            raise RuntimeError("the nixl KV transport needs NIXL: pip install 'pdserve[nixl]'")
        self.pool = pool  # [L, 2, N, block_size, Hkv, D], one allocation
        self.layout = pool_layout(pool)
        self.half = self.layout.cell_bytes() // 2  # K (or V) of one block in one layer
        self.mem = "VRAM" if pool.device.type == "cuda" else "DRAM"
        self.device_id = pool.device.index or 0
        # Only the side written into keeps NIXL's progress thread (peers' writes need it to
        # complete; it polls, pausing between polls: nixl_agent.py): a writer progresses while
        # it waits for its own.
        config = mod.nixl_agent_config(enable_prog_thread=serve, backends=["UCX"])
        self.agent = progress_agent(mod, agent_name, config)
        self.agent.register_memory(pool)
        self._lock = threading.Lock()  # the agent is built without thread sync (and staging)
        self.stage = stage
        self.stage_bytes = stage_bytes
        self.staging: torch.Tensor | None = None  # registered on first use

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
        for event in ready_events(ready):
            event.synchronize()  # the layers that wrote these blocks
        src0, dst0, lengths = block_runs(src_ids, dst_ids)
        nbytes = int(lengths.sum()) * 2 * (layers[1] - layers[0]) * self.half
        if self._stages(len(lengths), dst_ids):
            with self._lock:
                self._write_staged(peer, layers, src_ids, dst_ids)
            return nbytes
        local = run_descriptors(self.pool.data_ptr(), self.pool.shape[2], self.half, layers,
                                src0, lengths, self.device_id)
        remote = self._remote(peer, layers, dst0, lengths)
        with self._lock:
            self._transfer(peer, local, remote)
        return nbytes

    def _remote(self, peer: Peer, layers: tuple[int, int], starts: Any, lengths: Any) -> Any:
        info = peer.info
        return run_descriptors(info.nixl_pool_address, info.num_blocks, self.half, layers,
                               starts, lengths, info.nixl_device_id)

    def _stages(self, runs: int, dst_ids: list[int]) -> bool:
        if self.stage != "auto":
            return self.stage == "always"
        if self.pool.device.type != "cuda":  # a CPU's gather costs what the descriptors save
            return False
        dst_runs = 1 + int(np.count_nonzero(np.diff(np.asarray(dst_ids)) != 1))
        return runs >= STAGE_MIN_GAIN * dst_runs

    def _write_staged(self, peer: Peer, layers: tuple[int, int], src_ids: list[int],
                      dst_ids: list[int]) -> None:
        """The slab through the staging buffer, as many blocks at a time as it holds."""
        l0, l1 = layers
        block_bytes = 2 * (l1 - l0) * self.half  # one block of the slab's layers, K and V
        per_chunk = self.stage_bytes // block_bytes
        if per_chunk < 1:
            raise ValueError(f"a {self.stage_bytes}-byte staging buffer holds no block of "
                             f"{block_bytes} bytes")
        from kernels.kv_block_copy import copy_kv_blocks  # Triton: loaded when first staged

        staging, pool = self._staging(), self.pool
        for i in range(0, len(src_ids), per_chunk):
            src, dst = src_ids[i:i + per_chunk], dst_ids[i:i + per_chunk]
            m = len(src)
            view = staging[: m * block_bytes].view(pool.dtype).view(l1 - l0, 2, m,
                                                                     *pool.shape[3:])
            ids = torch.tensor([src, range(m)], dtype=torch.long, device=pool.device)
            copy_kv_blocks(pool[l0:l1], view, 0, l1 - l0, ids[0], ids[1])  # the gather
            if pool.device.type == "cuda":
                torch.cuda.current_stream(pool.device).synchronize()
            offsets, dst0, lengths = block_runs(list(range(m)), dst)
            local = run_descriptors(staging.data_ptr(), m, self.half, (0, l1 - l0), offsets,
                                    lengths, self.device_id)
            self._transfer(peer, local, self._remote(peer, layers, dst0, lengths))

    def _staging(self) -> torch.Tensor:
        if self.staging is None:
            self.staging = torch.empty(self.stage_bytes, dtype=torch.uint8,
                                       device=self.pool.device)
            self.agent.register_memory(self.staging)
        return self.staging

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
        with self._lock:
            for memory in (self.pool, self.staging):
                if memory is not None:
                    with contextlib.suppress(Exception):  # one failing leaves the other to go
                        self.agent.deregister_memory(self.agent.get_reg_descs(memory))
