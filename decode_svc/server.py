"""`pdserve decode`: a decode worker as its own process."""

from __future__ import annotations

import argparse
import asyncio

from decode_svc.receiver import KVReceiver
from decode_svc.service import DecodeServicer
from engine.config import KVWaitConfig
from pdserve.cluster.flags import add_flag
from pdserve.cluster.worker import add_worker_flags, build_engine, run_worker, watch_cancellations
from protos import decode_pb2_grpc

DEFAULT_PORT = 50061


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser, DEFAULT_PORT)
    add_flag(parser, "--kv-timeout", 30.0, type=float,
             help="seconds a Generate waits with no KV arriving (no header, no slab: the push "
                  "streams during the prefill) before failing")
    add_flag(parser, "--kv-wait-seconds", 30.0, type=float,
             help="seconds a Generate waits for free KV blocks when the cache is full, behind "
                  "those that came first, before failing with RESOURCE_EXHAUSTED (0: fail at "
                  "once)")
    add_flag(parser, "--kv-wait-max-requests", 64, type=int,
             help="Generates that may wait for free KV blocks at a time; more get "
                  "RESOURCE_EXHAUSTED at once")


async def serve(args: argparse.Namespace) -> None:
    engine = await asyncio.to_thread(build_engine, args, "decode")
    receiver = KVReceiver(engine, KVWaitConfig(args.kv_wait_seconds, args.kv_wait_max_requests))
    cancels = watch_cancellations(args, receiver.drop)
    servicer = DecodeServicer(engine, receiver, args.kv_timeout, cancels)
    await run_worker(
        args, "decode", engine, lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s),
        receiver.stats, cancels.stop,
    )


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
