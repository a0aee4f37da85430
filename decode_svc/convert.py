"""Decode service edge: its protobuf messages <-> engine objects."""

from __future__ import annotations

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
    )


def pool_info_from_pb(msg: decode_pb2.KVPoolInfo) -> PoolInfo:
    return PoolInfo(
        pool_id=msg.pool_id, host_id=msg.host_id, layout=layout_from_pb(msg.layout),
        num_blocks=msg.num_blocks, device_type=msg.device_type,
        transports=tuple(msg.transports), device_uuid=msg.device_uuid,
        cuda_ipc_handle=msg.cuda_ipc_handle, nixl_metadata=msg.nixl_metadata,
        nixl_pool_address=msg.nixl_pool_address, nixl_device_id=msg.nixl_device_id,
    )


def written_range(msg: decode_pb2.KVWritten) -> SlabRange:
    return msg.layer_start, msg.layer_end, msg.block_start, msg.block_end
