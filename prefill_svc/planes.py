"""Which data plane carries this prefill worker's KV to each decode worker, opened once per peer.

    first push to a decode worker ─▶ DescribeKV ─▶ choose_transport(--kv-transport, mine,
                                     theirs) ─▶ DescribeKV naming the choice (its export) ─▶
                                     open the peer's pool (map the IPC handle, add the NIXL
                                     agent) ─▶ logged once: "KV to <addr>: <transport>"
    a push refused as stale, or a peer gone (UNAVAILABLE) ─▶ `forget`: unmapped; the next push
                                     describes the worker again

A peer the chosen plane cannot reach (a GPU this process does not see, an unopenable handle)
falls back to grpc, logged; so does a decode worker that does not know DescribeKV.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
import torch

from decode_svc.convert import pool_info_from_pb
from engine.kv_transfer import pool_layout
from pdserve.transport.base import (
    GRPC,
    DataPlane,
    Peer,
    PeerUnreachable,
    PoolInfo,
    choose_transport,
    host_id,
    nixl_wanted,
    offered_transports,
)
from pdserve.transport.planes import make_plane
from protos import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class PeerPlanes:
    def __init__(self, pool: torch.Tensor, configured: str):
        self.pool = pool  # [L, 2, N, block_size, Hkv, D]
        self.configured = configured
        self.nixl = nixl_wanted(configured)
        self.local = PoolInfo(
            pool_id=uuid.uuid4().hex, host_id=host_id(), layout=pool_layout(pool),
            num_blocks=pool.shape[2], device_type=pool.device.type,
            transports=offered_transports(configured, pool.device.type, self.nixl),
        )
        self._planes: dict[str, DataPlane] = {}
        self._peers: dict[str, Peer | None] = {}  # decode address -> its plane (None: grpc)
        self._lock = asyncio.Lock()

    async def peer(self, address: str, channel: grpc.aio.Channel) -> Peer | None:
        """The opened data plane towards the decode worker at `address`; None for grpc."""
        if self.configured == GRPC:
            return None
        if address in self._peers:
            return self._peers[address]
        async with self._lock:  # one description per peer, however many pushes start
            if address not in self._peers:
                self._peers[address] = await self._open(address, channel)
        return self._peers[address]

    def known(self, address: str) -> Peer | None:
        """The data plane opened towards `address` already, if any (no rpc; None for a peer
        not described yet or pushed to over grpc)."""
        return self._peers.get(address)

    def plane(self, transport: str) -> DataPlane:
        if transport not in self._planes:
            self._planes[transport] = make_plane(transport, self.pool,
                                                 f"prefill-{self.local.pool_id}")
        return self._planes[transport]

    def forget(self, address: str) -> None:
        """Close the mapping to `address`'s pool; the next push describes it again."""
        peer = self._peers.pop(address, None)
        if peer is not None:
            self.plane(peer.transport).close_peer(peer)

    async def _open(self, address: str, channel: grpc.aio.Channel) -> Peer | None:
        """Describe the peer, choose, and only then ask for the chosen plane's export (which
        may start a plane there: a NIXL agent holds a core, so none starts for nothing)."""
        stub = decode_pb2_grpc.DecodeStub(channel)
        info = await _describe(stub, address, [])
        transport = GRPC if info is None else choose_transport(
            self.configured, self.local, info, self.nixl)
        if info is not None and transport != GRPC:
            info = await _describe(stub, address, [transport])
            if info is None or transport not in info.transports:  # it failed to start there
                transport = GRPC
        peer = None
        if info is not None and transport != GRPC:
            try:
                peer = await asyncio.to_thread(self.plane(transport).open_peer, info)
            except (PeerUnreachable, RuntimeError) as exc:
                logger.warning("KV to %s: %s unavailable (%s); using grpc", address, transport,
                               exc)
                transport = GRPC
        if self.configured not in ("auto", transport):
            logger.warning("KV to %s: %s is not possible for this pair; using %s", address,
                           self.configured, transport)
        logger.info("KV to %s: %s", address, transport)
        return peer

    def close(self) -> None:
        for address in list(self._peers):
            self.forget(address)
        for plane in self._planes.values():
            plane.close()


async def _describe(stub: decode_pb2_grpc.DecodeStub, address: str,
                    wanted: list[str]) -> PoolInfo | None:
    """The peer's pool with the exports of `wanted` planes; None if it does not know
    DescribeKV (an older worker: grpc). ConnectionError if the call fails."""
    try:
        return pool_info_from_pb(await stub.DescribeKV(
            decode_pb2.DescribeKVRequest(transports=wanted), timeout=30))
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise ConnectionError(f"DescribeKV of {address} failed: {exc.details()}") from exc
        return None
