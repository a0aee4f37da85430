"""The sending side of PushKVStreams (prefill_svc/push_streams.py) against a decode worker that
is gone: the push fails with the call's status, and nothing of the failed call outlives it. A
kept call object holds its connection's reconnect backoff, which gRPC shares with any new
channel to the same address: the push after a decode worker's restart then failed at once
("failed to connect to all addresses") although the new worker was serving. The shared call's
normal life (many pushes, cuts, outcomes) runs between real workers in
tests/test_kv_transfer_faults.py."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import grpc
import torch
from cluster import free_port
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prefill_svc.sender import PushKVSender
from protos import decode_pb2


async def _push_to_nobody(sender: PushKVSender, channel: grpc.aio.Channel, address: str,
                          rid: str) -> str:
    """A data-plane push's chunks on the shared call to `address` (nothing listens there), as
    `PushKVSender.send` makes it (its channel held meanwhile)."""

    async def chunks():
        yield decode_pb2.KVChunk(header=decode_pb2.KVHeader(request_id=rid, transport="nixl",
                                                            push_id=1))
        await asyncio.sleep(30)  # the commit never comes: the call fails first

    try:
        await sender._push_shared(address, channel, sender.new_push(rid, 16), 1, chunks())
    except ConnectionError as exc:
        return str(exc)
    raise AssertionError("the push to nobody succeeded")


def test_a_push_to_a_dead_peer_fails_and_a_restarted_one_is_reached_at_once() -> None:
    """With the collector off: a failed push's exception holds its frames in a cycle, and
    whatever they reference must not hold the call (in a server the collector runs late)."""

    async def run() -> None:
        sender = PushKVSender([torch.zeros(2, 4, 16, 2, 8) for _ in range(2)])
        address = f"127.0.0.1:{free_port()}"
        for i in range(3):  # the channel's reconnect backoff grows
            channel = sender._channel(address)
            message = await _push_to_nobody(sender, channel, address, f"r{i}")
            assert message.startswith(f"KV push to {address} failed: failed to connect")
            assert sender._channels == {} and sender._streams == {}  # dropped: peer gone
            await asyncio.sleep(1.0)
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(address)
        await server.start()
        await asyncio.sleep(0.2)
        try:  # the next push's first rpc, on a new channel, reaches the new server
            stub = health_pb2_grpc.HealthStub(sender._channel(address))
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await sender.close()
            await server.stop(0)

    gc.disable()
    try:
        asyncio.run(run())
    finally:
        gc.enable()


def test_a_decode_worker_of_an_earlier_version_gets_a_pushkv_stream_each() -> None:
    """DescribeKV says whether the decode worker serves PushKVStreams (a field an earlier
    version never sets): only then do data-plane pushes share the call, and only when the
    prefill worker shares them (--kv-push-streams shared)."""
    from decode_svc.convert import pool_info_from_pb, pool_info_to_pb
    from engine.kv_transfer import KVLayout
    from pdserve.transport.base import Peer, PoolInfo

    info = PoolInfo(pool_id="p", host_id="h", layout=KVLayout(2, 2, 8, "float32", 16),
                    num_blocks=8, device_type="cpu", transports=("nixl", "grpc"),
                    push_streams=True)
    assert pool_info_from_pb(pool_info_to_pb(info)) == info
    older = dataclasses.replace(info, push_streams=False)
    caches = [torch.zeros(2, 4, 16, 2, 8) for _ in range(2)]
    shared, apart = PushKVSender(caches), PushKVSender(caches, shared_streams=False)
    assert shared.shares_stream(Peer(info, "nixl"))
    assert not shared.shares_stream(Peer(older, "nixl"))
    assert not apart.shares_stream(Peer(info, "nixl"))
    message = decode_pb2.KVPoolInfo(pool_id="p")  # as an earlier version's DescribeKV
    assert not pool_info_from_pb(message).push_streams
