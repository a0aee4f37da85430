"""`pdserve decode`: a decode worker as its own process."""

from __future__ import annotations

import argparse
import asyncio
import logging

from decode_svc.receiver import KVReceiver
from decode_svc.service import DecodeServicer
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
from protos import decode_pb2_grpc

SERVICE = "pdserve.v1.Decode"
DEFAULT_PORT = 50061


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser, DEFAULT_PORT)
    add_flag(parser, "--kv-timeout", 30.0, type=float,
             help="seconds a Generate waits for its KV before failing")


async def serve(args: argparse.Namespace) -> None:
    engine = await asyncio.to_thread(build_engine, args, "decode")
    receiver = KVReceiver(engine)
    cancels = watch_cancellations(args, receiver.drop)
    servicer = DecodeServicer(engine, receiver, args.kv_timeout, cancels)
    server, health = await make_server(
        SERVICE, lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s)
    )
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()

    def counters() -> dict[str, float]:
        st = receiver.stats
        return {
            "kv_transfer_bytes": st.bytes_received,
            "kv_transfers": st.transfers_completed,
            "kv_transfer_failures": st.transfers_failed,
            "kv_transfer_seconds": st.transfer_seconds,
        }

    monitor = WorkerMonitor("decode", advertise_address(args), engine, counters)
    heartbeat = await start_monitoring(args, monitor)
    await set_serving(health, SERVICE)
    logging.getLogger(__name__).info("decode worker serving on %s", monitor.address)

    async def on_stop() -> None:
        await cancels.stop()
        if heartbeat is not None:
            await heartbeat.stop()

    await serve_until_signal(server, on_stop)
    engine.shutdown()


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
