"""The data-plane contract, the pool description a decode worker publishes, and the choice of
transport for a (prefill, decode) pair.

NOTE: a one-sided push, prefill side (the caller of `DataPlane.write`):

    DescribeKV (once per peer) ─▶ PoolInfo ─▶ choose_transport ─▶ plane.open_peer(info)
    KVTarget (per request)     ─▶ the reserved blocks' physical ids, a push id
    PushKV header(transport, push id)
    per slab: plane.write(peer, layers, my block ids, its block ids) returns once the bytes are
              in the peer's memory ─▶ KVWritten(range)
    KVCommit

and on the decode side (`decode_svc/receiver.py`): the blocks a target was handed out for are
freed only after every push stream that may write them has ended, plus a grace period (a
cancelled sender's last write may still land): nothing writes into blocks no longer reserved
for the request.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol

import torch

from engine.kv_transfer import KVLayout

GRPC, CUDA_IPC, NIXL, AUTO = "grpc", "cuda_ipc", "nixl", "auto"
TRANSPORTS = (GRPC, CUDA_IPC, NIXL)
CHOICES = (AUTO, *TRANSPORTS)  # --kv-transport


class PeerUnreachable(ConnectionError):
    """A data plane cannot reach the peer's pool (another host, an invisible GPU, a stale or
    unopenable handle): the pair falls back to grpc."""


@dataclass(frozen=True)
class PoolInfo:
    """A decode worker's KV pool as the data planes reach it (DescribeKV's reply)."""

    pool_id: str  # unique per process start
    host_id: str
    layout: KVLayout
    num_blocks: int
    device_type: str  # "cpu" | "cuda"
    transports: tuple[str, ...]  # accepted, best first; always ends with "grpc"
    device_uuid: str = ""
    cuda_ipc_handle: bytes = b""
    nixl_metadata: bytes = b""
    nixl_pool_address: int = 0
    nixl_device_id: int = 0
    doorbell: str = ""  # the commit doorbell's name on this host (pdserve/transport/doorbell.py)
    push_streams: bool = False  # serves PushKVStreams (a worker of an earlier version does not)


@dataclass
class Peer:
    """A decode worker's pool as one data plane on the prefill side has opened it."""

    info: PoolInfo
    transport: str
    handle: Any = None  # the plane's own: a mapped tensor, a NIXL remote agent name
    extra: dict[str, Any] = field(default_factory=dict)


class DataPlane(Protocol):
    """One-sided KV writes from this worker's pool into a peer's. `export` runs on the decode
    side (what DescribeKV publishes); the rest on the prefill side, `write` off the event loop."""

    name: str

    def export(self) -> dict[str, Any]:
        """PoolInfo fields that let a sender reach this worker's pool."""
        ...

    def open_peer(self, info: PoolInfo) -> Peer:
        """Map or connect the peer's pool (once per pool); PeerUnreachable if it cannot."""
        ...

    def write(self, peer: Peer, layers: tuple[int, int], src_ids: list[int],
              dst_ids: list[int], ready: Any = None) -> int:
        """Copy layers [l0, l1) of this pool's blocks `src_ids` into the peer's blocks
        `dst_ids` (after the CUDA event `ready`, or each event of a list, when given); returns
        once the bytes are in the peer's memory, with the bytes written. Raises ConnectionError
        on failure."""
        ...

    def close_peer(self, peer: Peer) -> None:
        """Forget the peer's pool (unmap, remove its agent); never raises."""
        ...

    def close(self) -> None:
        ...


def ready_events(ready: Any) -> list[Any]:
    """`DataPlane.write`'s `ready` as a list of events: None, one event, or a list of them."""
    if ready is None:
        return []
    return list(ready) if isinstance(ready, (list, tuple)) else [ready]


def choose_transport(requested: str, local: PoolInfo, peer: PoolInfo,
                     nixl_available: bool) -> str:
    """The transport a sender configured with `requested` (--kv-transport) uses towards `peer`.

    auto: cuda_ipc when both pools are on CUDA on the same host, nixl when it is installed here
    and offered there and the peers are on different hosts, else grpc. A named transport is used
    when it is possible for the pair, else grpc (the caller logs the fallback)."""
    if requested not in CHOICES:
        raise ValueError(f"kv transport must be one of {CHOICES}, got {requested!r}")
    same_host = local.host_id == peer.host_id
    possible = {
        CUDA_IPC: (CUDA_IPC in peer.transports and same_host
                   and local.device_type == peer.device_type == "cuda"),
        NIXL: NIXL in peer.transports and nixl_available,
        GRPC: True,
    }
    if requested == AUTO:
        if possible[CUDA_IPC]:
            return CUDA_IPC
        if possible[NIXL] and not same_host:
            return NIXL
        return GRPC
    return requested if possible[requested] else GRPC


def offered_transports(configured: str, device_type: str, nixl_available: bool) -> tuple[str, ...]:
    """What a decode worker with --kv-transport `configured` accepts, best first."""
    if configured not in CHOICES:
        raise ValueError(f"kv transport must be one of {CHOICES}, got {configured!r}")
    can = {CUDA_IPC: device_type == "cuda", NIXL: nixl_available, GRPC: True}
    wanted = TRANSPORTS if configured == AUTO else (configured, GRPC)
    return tuple(t for t in (CUDA_IPC, NIXL, GRPC) if t in wanted and can[t])


@cache
def host_id() -> str:
    """This machine: its boot id (distinct per machine and boot) and host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{boot}/{socket.gethostname()}"


def nixl_wanted(configured: str) -> bool:
    """Whether a worker with --kv-transport `configured` may use nixl and has it. Loads NIXL's
    native libraries only then (they crashed protoc run in the same process)."""
    return configured in (AUTO, NIXL) and nixl_available()


def nixl_available() -> bool:
    """Whether NIXL's Python package is installed (pdserve[nixl])."""
    from pdserve.transport.nixl import nixl_module

    return nixl_module() is not None


def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)
