"""Shipping a prefilled request's KV blocks to a decode worker.

The transfer sits behind `KVSender`, so another transport (CUDA IPC handles on one host, RDMA)
can replace gRPC without touching the engine or the servicer. `GrpcKVSender` streams PushKV:
one header, then slabs of a few MiB, each serialized off the event loop while the previous one
is on the wire.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from decode_svc.convert import layout_to_pb, slab_to_pb
from engine.kv_transfer import KVSlab, layout_of, read_slabs
from pdserve.cluster.convert import LogprobsTuple, logprobs_to_pb
from pdserve.cluster.grpc_server import open_channel
from protos import decode_pb2, decode_pb2_grpc


@dataclass
class KVTransfer:
    """One request's KV to ship: its blocks on this worker and what the header announces."""

    request_id: str
    num_tokens: int
    block_ids: list[int]
    first_token_id: int
    first_logprobs: LogprobsTuple | None = None


@dataclass
class SenderStats:
    bytes_sent: int = 0
    transfers_completed: int = 0
    transfers_failed: int = 0
    transfer_seconds: float = 0.0


class KVSender(Protocol):
    stats: SenderStats

    async def send(self, decode_address: str, transfer: KVTransfer) -> int:
        """Ship every block of `transfer` to the decode worker; returns bytes sent. Raises on
        failure (the caller frees the blocks either way)."""
        ...

    async def close(self) -> None:
        ...


class GrpcKVSender:
    def __init__(
        self, kv_caches: list[torch.Tensor], slab_bytes: int = 4 << 20, timeout_s: float = 60.0
    ):
        self.kv_caches = kv_caches
        self.layout = layout_of(kv_caches)
        self.slab_bytes = slab_bytes
        self.timeout_s = timeout_s
        self.stats = SenderStats()
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def send(self, decode_address: str, transfer: KVTransfer) -> int:
        stub = decode_pb2_grpc.DecodeStub(self._channel(decode_address))
        started = time.perf_counter()
        try:
            reply = await stub.PushKV(self._chunks(transfer), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.stats.transfers_failed += 1
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._drop_channel(decode_address)
            raise ConnectionError(f"KV push to {decode_address} failed: {exc.details()}") from exc
        self.stats.transfers_completed += 1
        self.stats.bytes_sent += reply.bytes_received
        self.stats.transfer_seconds += time.perf_counter() - started
        return reply.bytes_received

    async def _chunks(self, t: KVTransfer) -> AsyncIterator[decode_pb2.KVChunk]:
        header = decode_pb2.KVHeader(
            request_id=t.request_id, layout=layout_to_pb(self.layout), num_tokens=t.num_tokens,
            num_blocks=len(t.block_ids), first_token_id=t.first_token_id,
        )
        if t.first_logprobs is not None:
            header.first_logprobs.CopyFrom(logprobs_to_pb(t.first_logprobs))
        yield decode_pb2.KVChunk(header=header)
        slabs = read_slabs(self.kv_caches, t.block_ids, self.slab_bytes)
        while (slab := await asyncio.to_thread(_next_or_none, slabs)) is not None:
            yield slab_to_pb(slab)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return self._channels[address]

    async def _drop_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self._drop_channel(address)


def _next_or_none(slabs: Iterator[KVSlab]) -> KVSlab | None:
    return next(slabs, None)
