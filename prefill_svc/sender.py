"""Shipping a prefilled request's KV blocks to a decode worker.

The transfer sits behind `KVSender`, so another transport (CUDA IPC handles on one host, RDMA)
can replace gRPC without touching the engine or the servicer. `GrpcKVSender` streams PushKV:
one header, then slabs of a few MiB, each serialized off the event loop while the previous one
is on the wire.

NOTE: a slab costs one copy on this side before grpc's own. Its blocks are gathered
(`index_select`, GIL released) into a staging buffer reused for every slab of the push, then
joined behind a few bytes of KVChunk framing into the message's bytes, which go out as they are
(PushKV is called without a protobuf serializer). Building a KVData message instead costs four
copies: `.tobytes()`, the KVData into the KVChunk (upb serializes and re-parses a submessage
given to a constructor), and SerializeToString; that halved the transfer's throughput.

    cache[l][:, block_ids[b0:b1]] --index_select--> staging [l1-l0, 2, b1-b0, bs, Hkv, D]
    KVChunk framing (field 2, KVData fields 1-5) + staging bytes --join--> message bytes
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from decode_svc.convert import layout_to_pb
from engine.kv_transfer import SlabRange, layout_of, plan_slabs
from pdserve.cluster.convert import LogprobsTuple, logprobs_to_pb
from pdserve.cluster.grpc_server import open_channel
from pdserve.cluster.tls import PLAINTEXT, TLSConfig
from pdserve.cluster.worker import TransferStats
from protos import decode_pb2

_PUSH_KV = decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["PushKV"]
PUSH_KV = f"/{_PUSH_KV.containing_service.full_name}/{_PUSH_KV.name}"  # the rpc's path


@dataclass
class KVTransfer:
    """One request's KV to ship: its blocks on this worker and what the header announces."""

    request_id: str
    num_tokens: int
    block_ids: list[int]
    first_token_id: int
    first_logprobs: LogprobsTuple | None = None


class KVSender(Protocol):
    stats: TransferStats

    async def send(self, decode_address: str, transfer: KVTransfer) -> int:
        """Ship every block of `transfer` to the decode worker; returns bytes sent. Raises on
        failure (the caller frees the blocks either way)."""
        ...

    async def close(self) -> None:
        ...


class GrpcKVSender:
    def __init__(
        self, kv_caches: list[torch.Tensor], slab_bytes: int = 2 << 20, timeout_s: float = 60.0,
        tls: TLSConfig = PLAINTEXT,
    ):
        self.kv_caches = kv_caches
        self.tls = tls
        self.layout = layout_of(kv_caches)
        self.slab_bytes = slab_bytes
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def send(self, decode_address: str, transfer: KVTransfer) -> int:
        push = self._channel(decode_address).stream_unary(
            PUSH_KV, response_deserializer=decode_pb2.PushKVResponse.FromString
        )  # no request serializer: `messages` yields wire bytes
        started = time.perf_counter()
        try:
            reply = await push(self.messages(transfer), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.stats.failed += 1
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._drop_channel(decode_address)
            raise ConnectionError(f"KV push to {decode_address} failed: {exc.details()}") from exc
        self.stats.record(reply.bytes_received, time.perf_counter() - started)
        return reply.bytes_received

    async def messages(self, t: KVTransfer) -> AsyncIterator[bytes]:
        """The push's KVChunk messages as wire bytes: the header, then every slab (each
        gathered off the event loop). Reads the cache."""
        header = decode_pb2.KVHeader(
            request_id=t.request_id, layout=layout_to_pb(self.layout), num_tokens=t.num_tokens,
            num_blocks=len(t.block_ids), first_token_id=t.first_token_id,
        )
        if t.first_logprobs is not None:
            header.first_logprobs.CopyFrom(logprobs_to_pb(t.first_logprobs))
        yield decode_pb2.KVChunk(header=header).SerializeToString()
        stager = SlabStager(self.kv_caches, t.block_ids, self.slab_bytes)
        for slab in stager.ranges:
            yield await asyncio.to_thread(stager.encode, slab)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.tls)
        return self._channels[address]

    async def _drop_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self._drop_channel(address)


class SlabStager:
    """One push's slabs as KVChunk wire bytes, gathered through one reusable staging buffer
    (plus a host copy when the cache is not on the CPU). Not thread-safe: one slab at a time."""

    def __init__(
        self, kv_caches: list[torch.Tensor], block_ids: list[int], max_bytes: int
    ) -> None:
        self.kv_caches = kv_caches
        self.layout = layout_of(kv_caches)
        device = kv_caches[0].device
        self.block_ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        self.ranges = plan_slabs(self.layout, len(block_ids), max_bytes)
        size = max((_cells(r) for r in self.ranges), default=0) * self.layout.cell_bytes()
        self.staging = torch.empty(size, dtype=torch.uint8, device=device)
        self.host = self.staging
        if device.type != "cpu":
            self.host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def encode(self, slab: SlabRange) -> bytes:
        """KVChunk{data: KVData{range, bytes}} of layers [l0, l1) x blocks [b0, b1)."""
        l0, l1, b0, b1 = slab
        lay, nbytes = self.layout, _cells(slab) * self.layout.cell_bytes()
        out = self.staging[:nbytes].view(lay.torch_dtype).view(
            l1 - l0, 2, b1 - b0, lay.block_size, lay.num_kv_heads, lay.head_dim
        )
        for i, layer in enumerate(range(l0, l1)):
            torch.index_select(self.kv_caches[layer], 1, self.block_ids[b0:b1], out=out[i])
        host = self.host[:nbytes]
        if self.host is not self.staging:
            host.copy_(self.staging[:nbytes])
        return b"".join((slab_framing(slab, nbytes), host.numpy()))


def slab_framing(slab: SlabRange, nbytes: int) -> bytes:
    """The bytes of a KVChunk holding KVData(slab range, data of `nbytes`) up to the data itself:
    KVChunk field 2 (KVData) and, inside, uint32 fields 1-4 (zeros left out, as protobuf does)
    and bytes field 5. Equal to the head of `KVChunk(data=KVData(...)).SerializeToString()`."""
    fields = b"".join(
        bytes([tag]) + _varint(value)
        for tag, value in zip((0x08, 0x10, 0x18, 0x20), slab) if value
    ) + b"\x2a" + _varint(nbytes)
    return b"\x12" + _varint(len(fields) + nbytes) + fields


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _cells(slab: SlabRange) -> int:
    l0, l1, b0, b1 = slab
    return (l1 - l0) * (b1 - b0)
