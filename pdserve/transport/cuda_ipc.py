"""The `cuda_ipc` data plane: on one host, the prefill worker maps the decode worker's KV pool by
its CUDA IPC handle and copies its blocks straight into the reserved ones, GPU to GPU.

    decode worker: pool [L, 2, N, bs, Hkv, D] (one cudaMalloc) ─_share_cuda_─▶ handle (DescribeKV)
    prefill worker: handle ─_new_shared_cuda─▶ the same memory as a tensor on its device
                    (found by the GPU's UUID: CUDA_VISIBLE_DEVICES numbers GPUs per process)
    per slab: wait for the layers' event, copy_kv_blocks(my pool -> its pool) on a stream of
              its own, synchronize: the bytes are in the peer's memory before KVWritten goes

Across two GPUs of the host the peer's pool is first opened in this GPU's context (CUDA's
`cudaIpcOpenMemHandle` maps memory of another device into the current device's context, peer
access enabled), where this GPU's block-copy kernel addresses it: then every slab is one pass
of the kernel, storing into the peer's blocks over NVLink (or PCIe), if its probe passes (the
kernel reads block 0 of every layer of the mapped pool and must get what torch's copy gets:
reading moves nothing into the peer's blocks; a mismatch, the peer writing block 0 meanwhile,
only costs a slower way). On two H200s (NV18, 2026-11-29) it passed, and the kernel wrote 16k
tokens of the 1B shape at 0.88x a peer copy_ on the GPU (pdserve.bench.transfer --decode-gpu 1).
PDSERVE_CUDA_IPC_MAP_HERE=0 skips it. Otherwise (or if its probe fails) the handle is opened in
the context of the pool's own GPU (torch's way), where this GPU's Triton kernel cannot address
it ("Pointer argument cannot be accessed", seen on the same H200s), and a slab goes the first
way of these whose probe passes:

    kernel       as above (for a driver that lets it)
    copy engine  one cudaMemcpy2DAsync per run of blocks consecutive on both sides
                 (pdserve/transport/block_runs.py): a peer copy's speed when the runs are few
                 (a fresh pool's), a call a block when fragmented: used for at most
                 MAX_COPY_ENGINE_RUNS runs a slab
    three passes gathered here, copied to the peer GPU, scattered there (any slab)

A handle is opened once per peer pool (the driver allows one mapping per process); a restarted
decode worker has a new pool_id, and KVTarget refuses the old one before anything is written.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from engine.kv_transfer import pool_layout
from kernels.kv_block_copy import copy_kv_blocks
from kernels.kv_cache_fp8 import as_bytes, index_copy_kv
from pdserve.transport.base import (
    CUDA_IPC,
    Peer,
    PeerUnreachable,
    PoolInfo,
    device_uuid,
    ready_events,
)
from pdserve.transport.block_runs import copy_block_runs, runs

logger = logging.getLogger(__name__)
# PDSERVE_KV_WRITE_TRACE=1: log each write's phases (host ms: ids, launch, synchronize; GPU ms
# of the copy from CUDA events) at WARNING, to find where a write's time goes
TRACE = os.environ.get("PDSERVE_KV_WRITE_TRACE") == "1"
# Past this many runs of consecutive blocks a slab's copy-engine calls cost more than the three
# passes (pdserve.bench.gpu_kv_copy --peer, two H200s: 64 single-block calls for 32 MiB moved
# 0.17x a peer copy_, one call 1.08x).
MAX_COPY_ENGINE_RUNS = 8
KERNEL, COPY_ENGINE, THREE_PASSES = "kernel", "copy engine", "three passes"
# open another GPU's pool in this GPU's context first (the module's NOTE); =0: torch's way only
MAP_HERE = os.environ.get("PDSERVE_CUDA_IPC_MAP_HERE", "1") != "0"


class CudaIpcPlane:
    name = CUDA_IPC

    def __init__(self, pool: torch.Tensor):
        if pool.device.type != "cuda" or not pool.is_contiguous():
            raise ValueError("the cuda_ipc KV transport needs one contiguous CUDA pool")
        self.pool = pool  # [L, 2, N, block_size, Hkv, D]
        self.layout = pool_layout(pool)
        # per writing thread (pushes of several requests write at once): its stream, so that a
        # write waits for its own layers only, and its pinned block-id buffer
        self._local = threading.local()

    def export(self) -> dict[str, Any]:
        storage = self.pool.untyped_storage()
        (device, handle, size, offset, rc_handle, rc_offset, event, event_sync) = (
            storage._share_cuda_())
        fields = {
            "handle": _b64(handle), "size": size, "offset": offset, "rc_handle": _b64(rc_handle),
            "rc_offset": rc_offset, "event": _b64(event), "event_sync": bool(event_sync),
            "tensor_offset": self.pool.storage_offset(), "shape": list(self.pool.shape),
        }
        return {"cuda_ipc_handle": json.dumps(fields).encode(),
                "device_uuid": device_uuid(self.pool.device)}

    def open_peer(self, info: PoolInfo) -> Peer:
        if info.layout != self.layout:
            raise PeerUnreachable(f"KV pool {info.pool_id} has layout {info.layout}, "
                                  f"this worker {self.layout}")
        index = _visible_index(info.device_uuid)
        if index is None:
            raise PeerUnreachable(f"the GPU of KV pool {info.pool_id} ({info.device_uuid}) is "
                                  "not visible to this worker")
        here = self.pool.device.index
        if MAP_HERE and index != here:
            mapped = self._map_here(info)
            if mapped is not None:
                return Peer(info, CUDA_IPC, mapped, {"ways": [KERNEL]})
        mapped = self._map(info, index)
        ways = [KERNEL]
        if mapped.device != self.pool.device:
            ways = _peer_ways(self.pool, mapped)
            logger.info("KV pool %s on %s: written by %s", info.pool_id, mapped.device,
                        " else ".join(ways))
        return Peer(info, CUDA_IPC, mapped, {"ways": ways})

    def _map(self, info: PoolInfo, index: int) -> torch.Tensor:
        """The peer's pool as a tensor, its handle opened in the context of GPU `index`."""
        try:
            fields = json.loads(info.cuda_ipc_handle)
            storage = torch.UntypedStorage._new_shared_cuda(
                index, _unb64(fields["handle"]), fields["size"], fields["offset"],
                _unb64(fields["rc_handle"]), fields["rc_offset"], _unb64(fields["event"]),
                fields["event_sync"])
            shape = tuple(fields["shape"])
            mapped = torch.empty(0, dtype=self.pool.dtype, device=f"cuda:{index}").set_(
                storage, fields["tensor_offset"], shape)
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise PeerUnreachable(f"cannot open the CUDA IPC handle of KV pool "
                                  f"{info.pool_id}: {exc}") from exc
        if shape[2] != info.num_blocks:
            raise PeerUnreachable(f"KV pool {info.pool_id}: {shape[2]} blocks mapped, "
                                  f"{info.num_blocks} announced")
        return mapped

    def _map_here(self, info: PoolInfo) -> torch.Tensor | None:
        """MAP_HERE: the peer's pool (another GPU's memory) opened in this GPU's context, where
        the kernel can address it, if the kernel then reads what torch's copy reads; else None
        (the mapping closed again, for `_map` to open it in its own GPU's context)."""
        try:
            mapped = self._map(info, self.pool.device.index)
            if _reads_alike(KERNEL, mapped, mapped[:, :, :1].clone()):
                logger.info("KV pool %s mapped on %s: written by the kernel", info.pool_id,
                            self.pool.device)
                return mapped
            logger.warning("KV pool %s mapped on %s: the kernel read other bytes",
                           info.pool_id, self.pool.device)
        except (PeerUnreachable, RuntimeError, ValueError) as exc:
            logger.warning("KV pool %s cannot be mapped on %s: %s", info.pool_id,
                           self.pool.device, exc)
        mapped = None  # the last reference: the mapping closes before ipc_collect
        torch.cuda.ipc_collect()
        return None

    def write(self, peer: Peer, layers: tuple[int, int], src_ids: list[int],
              dst_ids: list[int], ready: Any = None) -> int:
        dst_pool: torch.Tensor = peer.handle
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.pool.device)
        marks = [time.perf_counter()] if TRACE else []
        with torch.cuda.stream(stream):
            for event in ready_events(ready):
                stream.wait_event(event)  # the layers that wrote these blocks
            way, block_runs = self._way(peer, src_ids, dst_ids)
            ids = None if way == COPY_ENGINE else self._ids_to(
                self.pool.device if way == KERNEL else dst_pool.device, src_ids, dst_ids)
            if TRACE:
                marks.append(time.perf_counter())
                events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                events[0].record(stream)
            if way == KERNEL:  # this GPU's kernel writes the peer's blocks (one pass)
                copy_kv_blocks(self.pool, dst_pool, layers[0], layers[1], ids[0], ids[1],
                               peer=True)
            elif way == COPY_ENGINE:  # a cudaMemcpy2DAsync a run, on this stream
                copy_block_runs(self.pool, dst_pool, layers[0], layers[1], block_runs)
            else:  # another GPU of this host: gather here, then one peer copy and a scatter
                l0, l1 = layers
                src = ids[0].to(self.pool.device)
                rows = as_bytes(self.pool[l0:l1]).index_select(2, src).to(dst_pool.device)
                index_copy_kv(as_bytes(dst_pool[l0:l1]), 2, ids[1], rows)  # that GPU's stream
                torch.cuda.current_stream(dst_pool.device).synchronize()  # written before acks
            if TRACE:
                events[1].record(stream)
                marks.append(time.perf_counter())
        stream.synchronize()
        if TRACE:
            marks.append(time.perf_counter())
            ids_ms, launch_ms, sync_ms = (1e3 * (b - a) for a, b in zip(marks, marks[1:]))
            logger.warning("cuda_ipc write, %d blocks x %d layers to %s (%s): ids %.3f, launch "
                           "%.3f, synchronize %.3f ms; copy on the GPU %.3f ms", len(src_ids),
                           layers[1] - layers[0], dst_pool.device, way, ids_ms, launch_ms,
                           sync_ms, events[0].elapsed_time(events[1]))
        return len(src_ids) * (layers[1] - layers[0]) * self.layout.cell_bytes()

    @staticmethod
    def _way(peer: Peer, src_ids: list[int], dst_ids: list[int]
             ) -> tuple[str, list[tuple[int, int, int]]]:
        """How this slab goes (the module's NOTE), and its runs when by the copy engine."""
        ways = peer.extra.get("ways", [KERNEL])
        if ways[0] == KERNEL:
            return KERNEL, []
        if ways[0] == COPY_ENGINE:
            block_runs = runs(np.asarray(src_ids), np.asarray(dst_ids))
            if len(block_runs) <= MAX_COPY_ENGINE_RUNS:
                return COPY_ENGINE, block_runs
        return THREE_PASSES, []

    def _ids_to(self, device: torch.device, src_ids: list[int], dst_ids: list[int]
                ) -> torch.Tensor:
        """[2, n] int64 block ids on `device`, through a pinned buffer of this thread's, reused
        by its next write (a write synchronizes before it returns; writes of other pushes run
        on other threads at the same time): a list's ints to a tensor one by one cost ~0.3 ms
        at a thousand blocks, numpy's conversion a tenth of it."""
        n = len(src_ids)
        buffer = getattr(self._local, "ids", None)
        if buffer is None or buffer.numel() < 2 * n:
            buffer = self._local.ids = torch.empty(2 * n, dtype=torch.long, pin_memory=True)
        host = buffer[: 2 * n]
        view = host.numpy()
        view[:n] = src_ids
        view[n:] = dst_ids
        return host.view(2, n).to(device, non_blocking=True)

    def close_peer(self, peer: Peer) -> None:
        peer.handle = None  # the mapping closes with the last reference to its storage
        torch.cuda.ipc_collect()

    def close(self) -> None:
        pass


def _peer_ways(local: torch.Tensor, mapped: torch.Tensor) -> list[str]:
    """The ways to write `mapped` (a pool on another GPU, mapped here) from `local`'s GPU that
    pass their probe, fastest first, three passes last (the module's NOTE). Each probe reads
    block 0 of every layer of `mapped` and compares it with torch's copy of it."""
    here, there = local.device, mapped.device
    if not torch.cuda.can_device_access_peer(here.index, there.index):
        logger.warning("GPU %s has no peer access to %s", here, there)
        return [THREE_PASSES]
    expected = mapped[:, :, :1].to(here)
    expected.to(there)  # device-to-device copies: torch enables the source GPU's access
    ways = []
    for way in (KERNEL, COPY_ENGINE):
        try:
            if _reads_alike(way, mapped, expected):
                ways.append(way)
            else:
                logger.warning("the %s's probe of %s read other bytes", way, there)
        except (RuntimeError, ValueError) as exc:  # Triton refusing the pointer, a CUDA error
            logger.warning("the %s cannot reach the pool on %s: %s", way, there, exc)
    return [*ways, THREE_PASSES]


def _reads_alike(way: str, mapped: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether `way` (KERNEL or COPY_ENGINE), run on `expected`'s GPU, reads block 0 of every
    layer of `mapped` as `expected` holds it. Raises what the way raises."""
    probe = torch.empty_like(expected)
    if way == KERNEL:
        ids = torch.zeros(1, dtype=torch.long, device=expected.device)
        copy_kv_blocks(mapped, probe, 0, mapped.shape[0], ids, ids, peer=True)
    else:  # queued on the mapped pool's GPU, the source's
        with torch.cuda.stream(torch.cuda.current_stream(mapped.device)):
            copy_block_runs(mapped, probe, 0, mapped.shape[0], [(0, 0, 1)])
    for device in {expected.device, mapped.device}:
        torch.cuda.synchronize(device)
    return torch.equal(as_bytes(probe), as_bytes(expected))


def _visible_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid`, or None if it cannot see it."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    return None


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
