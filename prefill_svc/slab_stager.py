"""A grpc push's slabs as PushKV wire bytes (prefill_svc/sender.py sends them).

NOTE: a slab costs one copy on this side before grpc's own. Its blocks are gathered
(`index_select`, GIL released) into a staging buffer reused for every slab of the push, then
joined behind a few bytes of KVChunk framing into the message's bytes, which go out as they are
(PushKV is called without a protobuf serializer). Building a KVData message instead costs four
copies: `.tobytes()`, the KVData into the KVChunk (upb serializes and re-parses a submessage
given to a constructor), and SerializeToString; that halved the transfer's throughput.

    cache[l][:, block_ids[b0:b1]] --index_select--> staging [l1-l0, 2, b1-b0, bs, Hkv, D]
    KVChunk framing (field 2, KVData fields 1-5) + staging bytes --join--> message bytes

On CUDA the gather runs on a stream of its own, after the event the engine recorded behind the
layers that wrote those blocks (`KVProgress.ready`), then copies to pinned host memory and
synchronizes, all inside `SlabTicket.reading()` so that a preemption cannot hand the blocks to
another request mid-read. (This path is not exercised by the CPU test suite.)
"""

from __future__ import annotations

import torch

from engine.kv_transfer import SlabRange, layout_of, read_blocks
from prefill_svc.push import SlabTicket


class SlabStager:
    """A push's slabs as KVChunk wire bytes, gathered through one reusable staging buffer (plus
    a pinned host copy and a stream of its own when the cache is on a GPU). Not thread-safe:
    one slab at a time."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.layout = layout_of(kv_caches)
        self.device = kv_caches[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.staging = self.host = torch.empty(0, dtype=torch.uint8, device=self.device)

    def encode(self, ticket: SlabTicket) -> bytes | None:
        """KVChunk{data: KVData{range, bytes}} of the ticket's layers [l0, l1) x blocks
        [b0, b1); None if a preemption made the ticket stale (its blocks may be another
        request's by now)."""
        nbytes = cells(ticket.slab) * self.layout.cell_bytes()
        self._reserve(nbytes)
        with ticket.reading() as current:
            if not current:
                return None
            if self.stream is None:
                self._gather(ticket, nbytes)
            else:
                with torch.cuda.stream(self.stream):
                    if ticket.ready is not None:
                        self.stream.wait_event(ticket.ready)  # the layers that wrote them
                    self._gather(ticket, nbytes)
                    self.host[:nbytes].copy_(self.staging[:nbytes], non_blocking=True)
                self.stream.synchronize()
        return b"".join((slab_framing(ticket.slab, nbytes), self.host[:nbytes].numpy()))

    def _gather(self, ticket: SlabTicket, nbytes: int) -> None:
        l0, l1, b0, b1 = ticket.slab
        lay = self.layout
        ids = torch.tensor(ticket.block_ids, dtype=torch.long, device=self.device)
        out = self.staging[:nbytes].view(lay.torch_dtype).view(
            l1 - l0, 2, b1 - b0, lay.block_size, lay.num_kv_heads, lay.head_dim
        )
        for i, layer in enumerate(range(l0, l1)):
            read_blocks(self.kv_caches[layer], ids, out[i])

    def _reserve(self, nbytes: int) -> None:
        """Grow the staging buffer (and its host copy) to hold `nbytes`."""
        if self.staging.numel() >= nbytes:
            return
        if self.stream is None:
            self.staging = self.host = torch.empty(nbytes, dtype=torch.uint8)
            return
        with torch.cuda.stream(self.stream):
            self.staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


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


def cells(slab: SlabRange) -> int:
    """Layer x block cells of a slab."""
    l0, l1, b0, b1 = slab
    return (l1 - l0) * (b1 - b0)
