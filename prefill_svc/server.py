"""`pdserve prefill`: a prefill worker as its own process."""

from __future__ import annotations

import argparse
import asyncio

from pdserve.cluster.flags import add_flag
from pdserve.cluster.worker import add_worker_flags, build_engine, run_worker, watch_cancellations
from prefill_svc.sender import GrpcKVSender
from prefill_svc.service import PrefillServicer
from protos import prefill_pb2_grpc

DEFAULT_PORT = 50071


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser, DEFAULT_PORT)
    add_flag(parser, "--kv-slab-bytes", 2 << 20, type=int, help="bytes per KV transfer message")


async def serve(args: argparse.Namespace) -> None:
    engine = await asyncio.to_thread(build_engine, args, "prefill")
    sender = GrpcKVSender(engine.engine.runner.kv_caches, args.kv_slab_bytes)
    cancels = watch_cancellations(args, lambda request_id: servicer.abort(request_id))
    servicer = PrefillServicer(engine, sender, cancels)

    async def on_stop() -> None:
        await cancels.stop()
        await sender.close()

    await run_worker(
        args, "prefill", engine,
        lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
        sender.stats, on_stop,
    )


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
