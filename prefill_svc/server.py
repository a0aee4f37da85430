"""`pdserve prefill`: a prefill worker as its own process."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.cluster.flags import add_flag
from pdserve.cluster.grpc_server import make_server, serve_until_signal, set_serving
from pdserve.cluster.worker import (
    WorkerMonitor,
    add_worker_flags,
    advertise_address,
    build_engine,
    start_monitoring,
    watch_cancellations,
)
from prefill_svc.sender import GrpcKVSender
from prefill_svc.service import PrefillServicer
from protos import prefill_pb2_grpc

SERVICE = "pdserve.v1.Prefill"
DEFAULT_PORT = 50071


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser, DEFAULT_PORT)
    add_flag(parser, "--kv-slab-bytes", 4 << 20, type=int, help="bytes per KV transfer message")


async def serve(args: argparse.Namespace) -> None:
    engine = await asyncio.to_thread(build_engine, args, "prefill")
    sender = GrpcKVSender(engine.engine.runner.kv_caches, args.kv_slab_bytes)
    cancels = watch_cancellations(args, lambda request_id: servicer.abort(request_id))
    servicer = PrefillServicer(engine, sender, cancels)
    server, health = await make_server(
        SERVICE, lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s)
    )
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()

    def counters() -> dict[str, float]:
        st = sender.stats
        return {
            "kv_transfer_bytes": st.bytes_sent,
            "kv_transfers": st.transfers_completed,
            "kv_transfer_failures": st.transfers_failed,
            "kv_transfer_seconds": st.transfer_seconds,
        }

    monitor = WorkerMonitor("prefill", advertise_address(args), engine, counters)
    heartbeat = await start_monitoring(args, monitor)
    await set_serving(health, SERVICE)
    logging.getLogger(__name__).info("prefill worker serving on %s", monitor.address)

    async def on_stop() -> None:
        await cancels.stop()
        if heartbeat is not None:
            await heartbeat.stop()
        await sender.close()

    await serve_until_signal(server, on_stop)
    engine.shutdown()


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
