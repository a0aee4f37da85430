"""`pdserve prefill`: a prefill worker as its own process."""

from __future__ import annotations

import argparse
import asyncio

from pdserve.cluster.drain import DrainGate
from pdserve.cluster.flags import (
    add_flag,
    add_kv_push_streams_flag,
    add_kv_transport_flag,
    add_shared_gpu_step_marks_flag,
    add_worker_engine_core_flag,
)
from pdserve.cluster.tls import tls_from_args
from pdserve.cluster.worker import (
    add_worker_flags,
    build_engine,
    kv_transport_for,
    run_worker,
    serial_host_threads,
    watch_cancellations,
)
from prefill_svc.core_client import PrefillCoreClient
from prefill_svc.lease import KVLeases
from prefill_svc.planes import PeerPlanes
from prefill_svc.sender import PushKVSender
from prefill_svc.service import PrefillServicer
from protos import prefill_pb2_grpc

DEFAULT_PORT = 50071


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser, DEFAULT_PORT)
    add_flag(parser, "--kv-slab-bytes", 2 << 20, type=int, help="bytes per KV transfer message")
    add_kv_transport_flag(parser)
    add_kv_push_streams_flag(parser)
    add_shared_gpu_step_marks_flag(parser)
    add_worker_engine_core_flag(parser, "prefill")
    add_flag(parser, "--kv-lease-seconds", 30.0, type=float,
             help="seconds a prefilled request's KV waits for its decode worker to take it "
                  "before it is freed")


async def serve(args: argparse.Namespace) -> None:
    serial_host_threads(args)
    engine = await asyncio.to_thread(build_engine, args, "prefill")
    args.kv_transport = kv_transport_for(args)
    if isinstance(engine, PrefillCoreClient):  # the engine in a process of its own
        pool = await asyncio.to_thread(engine.kv_pool)  # mapped here: the pushes read it
        kv_view = list(pool.unbind(0))
    else:
        pool = engine.engine.runner.kv_pool
        kv_view = await asyncio.to_thread(engine.engine.runner.kv_view)  # every rank's
    planes = PeerPlanes(pool, args.kv_transport)
    sender = PushKVSender(kv_view, args.kv_slab_bytes, tls=tls_from_args(args), planes=planes,
                          shared_streams=args.kv_push_streams == "shared")
    cancels = watch_cancellations(args, lambda request_id: servicer.abort(request_id))
    gate = DrainGate()
    servicer = PrefillServicer(engine, sender, cancels, len(kv_view), gate)
    leases = KVLeases(engine, args.kv_lease_seconds, servicer.expire, sender.stats)
    leases.start()

    async def on_stop() -> None:
        await leases.stop()
        await cancels.stop()
        await sender.close()

    await run_worker(
        args, "prefill", engine,
        lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
        sender.stats, on_stop, busy=lambda: bool(servicer.pushes), gate=gate,
    )


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
