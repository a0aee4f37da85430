"""Decode service edge: its protobuf messages <-> engine objects."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from engine.kv_transfer import KVLayout, KVSlab, SlabRange
from engine.outputs import RequestOutput
from pdserve.cluster.convert import logprobs_from_pb, logprobs_to_pb
from pdserve.transport.base import PoolInfo
from protos import decode_pb2


def delta_to_pb(out: RequestOutput) -> decode_pb2.GenerateResponse:
    """One engine delta (single sequence) as a stream message."""
    c = out.outputs[0]
    msg = decode_pb2.GenerateResponse(token_ids=c.token_ids, finish_reason=c.finish_reason or "")
    for token_id, step in zip(c.token_ids, c.logprobs or []):
        top = {t: lp.logprob for t, lp in step.items() if lp.rank is not None}
        msg.logprobs.append(logprobs_to_pb((step[token_id].logprob, top)))
    if isinstance(c.stop_reason, int):
        msg.stop_token_id = c.stop_reason
    return msg


def layout_from_pb(msg: decode_pb2.KVLayout) -> KVLayout:
    return KVLayout(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.dtype, msg.block_size)


def layout_to_pb(layout: KVLayout) -> decode_pb2.KVLayout:
    return decode_pb2.KVLayout(
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, dtype=layout.dtype, block_size=layout.block_size,
    )


def slab_from_pb(msg: decode_pb2.KVData) -> KVSlab:
    return KVSlab(msg.layer_start, msg.layer_end, msg.block_start, msg.block_end, msg.data)


def chunk_from_wire(message: bytes) -> decode_pb2.KVChunk | KVSlab:
    """A PushKV message as grpc received it: a KVData chunk as a KVSlab whose data is a view
    of `message` (protobuf's `.data` would copy the slab's bytes into fresh memory);
    any other chunk (or an unusual encoding of one) parsed by protobuf. ValueError if it is no
    KVChunk."""
    slab = _slab_in_place(memoryview(message))
    if slab is not None:
        return slab
    try:
        return decode_pb2.KVChunk.FromString(message)
    except DecodeError as exc:
        raise ValueError(f"a PushKV message is not a KVChunk: {exc}") from exc


def _slab_in_place(m: memoryview) -> KVSlab | None:
    """KVChunk{data: KVData} as the sender frames it (prefill_svc/sender.py `slab_framing`):
    field 2 spanning the whole message, inside it uint32 fields 1-4 and bytes field 5 in any
    order. None for anything else, left to protobuf."""
    if len(m) < 2 or m[0] != 0x12:
        return None
    end, pos = _varint(m, 1)
    if end is None or pos + end != len(m):
        return None
    values, data = [0, 0, 0, 0], m[0:0]
    while pos < len(m):
        tag, pos = _varint(m, pos)
        if tag in (0x08, 0x10, 0x18, 0x20):
            value, pos = _varint(m, pos)
            if value is None or value >> 32:
                return None
            values[(tag >> 3) - 1] = value
        elif tag == 0x2A:
            size, pos = _varint(m, pos)
            if size is None or pos + size > len(m):
                return None
            data, pos = m[pos:pos + size], pos + size
        else:
            return None
    return KVSlab(*values, data)


def _varint(m: memoryview, pos: int) -> tuple[int | None, int]:
    """The varint at `pos` and the position after it; None if it runs past the end."""
    value = shift = 0
    while pos < len(m) and shift < 64:
        byte = m[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos
    return None, pos


def slab_to_pb(slab: KVSlab) -> decode_pb2.KVChunk:
    return decode_pb2.KVChunk(data=decode_pb2.KVData(
        layer_start=slab.layer_start, layer_end=slab.layer_end,
        block_start=slab.block_start, block_end=slab.block_end, data=slab.data,
    ))


def first_logprobs(commit: decode_pb2.KVCommit) -> tuple[float, dict[int, float]] | None:
    return logprobs_from_pb(commit.first_logprobs) if commit.HasField("first_logprobs") else None


def pool_info_to_pb(info: PoolInfo) -> decode_pb2.KVPoolInfo:
    return decode_pb2.KVPoolInfo(
        pool_id=info.pool_id, host_id=info.host_id, layout=layout_to_pb(info.layout),
        num_blocks=info.num_blocks, device_type=info.device_type,
        device_uuid=info.device_uuid, transports=info.transports,
        cuda_ipc_handle=info.cuda_ipc_handle, nixl_metadata=info.nixl_metadata,
        nixl_pool_address=info.nixl_pool_address, nixl_device_id=info.nixl_device_id,
        doorbell=info.doorbell, push_streams=info.push_streams,
    )


def pool_info_from_pb(msg: decode_pb2.KVPoolInfo) -> PoolInfo:
    return PoolInfo(
        pool_id=msg.pool_id, host_id=msg.host_id, layout=layout_from_pb(msg.layout),
        num_blocks=msg.num_blocks, device_type=msg.device_type,
        transports=tuple(msg.transports), device_uuid=msg.device_uuid,
        cuda_ipc_handle=msg.cuda_ipc_handle, nixl_metadata=msg.nixl_metadata,
        nixl_pool_address=msg.nixl_pool_address, nixl_device_id=msg.nixl_device_id,
        doorbell=msg.doorbell, push_streams=msg.push_streams,
    )


def written_range(msg: decode_pb2.KVWritten) -> SlabRange:
    return msg.layer_start, msg.layer_end, msg.block_start, msg.block_end
