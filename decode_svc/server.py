"""`pdserve decode`: a decode worker as its own process."""

from __future__ import annotations

import argparse
import asyncio

from decode_svc.core_client import CorePoolExporter, DecodeCoreClient
from decode_svc.pool import PoolExporter
from decode_svc.receiver import KVReceiver
from decode_svc.service import DecodeServicer, add_to_server
from engine.config import KVWaitConfig
from pdserve.cluster.drain import DrainGate
from pdserve.cluster.flags import (
    add_flag,
    add_kv_doorbell_flag,
    add_kv_transport_flag,
    add_shared_gpu_pace_flags,
    add_shared_gpu_step_marks_flag,
    add_worker_engine_core_flag,
)
from pdserve.cluster.worker import (
    add_worker_flags,
    build_engine,
    kv_transport_for,
    run_worker,
    serial_host_threads,
    watch_cancellations,
)
from pdserve.transport.base import GRPC
from pdserve.transport.doorbell import DoorbellListener

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
    add_kv_transport_flag(parser)
    add_flag(parser, "--kv-write-grace-seconds", 1.0, type=float,
             help="after a request whose KV a data plane (cuda_ipc, nixl) writes is dropped, "
                  "seconds its blocks stay reserved once the writing pushes ended (a cancelled "
                  "sender's last write may still land)")
    add_kv_doorbell_flag(parser)
    add_shared_gpu_pace_flags(parser)
    add_shared_gpu_step_marks_flag(parser)
    add_worker_engine_core_flag(parser, "decode")
    add_flag(parser, "--kv-wait-max-requests", 64, type=int,
             help="Generates that may wait for free KV blocks at a time; more get "
                  "RESOURCE_EXHAUSTED at once")


async def serve(args: argparse.Namespace) -> None:
    serial_host_threads(args)
    engine = await asyncio.to_thread(build_engine, args, "decode")
    args.kv_transport = kv_transport_for(args)
    kv_wait = KVWaitConfig(args.kv_wait_seconds, args.kv_wait_max_requests)
    if isinstance(engine, DecodeCoreClient):  # the engine in a process of its own
        exporter: PoolExporter | CorePoolExporter = CorePoolExporter(engine)
        receiver = KVReceiver(engine, kv_wait, exporter, args.kv_write_grace_seconds,
                              args.kv_timeout, kv_caches=engine.kv_caches, layout=exporter.layout)
        if args.kv_transport == GRPC:  # every push writes here: map the pool now, off the loop
            await asyncio.to_thread(engine.kv_caches)
    else:
        exporter = PoolExporter(engine.engine.runner.kv_pool, args.kv_transport)
        await asyncio.to_thread(engine.engine.runner.kv_view)  # every rank's pool mapped here
        receiver = KVReceiver(engine, kv_wait, exporter, args.kv_write_grace_seconds,
                              args.kv_timeout)
    doorbell = None
    if args.kv_doorbell == "on" and any(t != GRPC for t in exporter.offered):
        doorbell = DoorbellListener(exporter.pool_id)
        exporter.doorbell = doorbell.name
        if isinstance(engine, DecodeCoreClient):  # no engine thread here: the waker commits
            doorbell.wake_on_ring(lambda: _answer(doorbell, receiver))
        else:  # the engine thread drains it between steps, woken when idle
            engine.between_steps(lambda: _answer(doorbell, receiver))
            doorbell.wake_on_ring(engine.wake)
    cancels = watch_cancellations(args, receiver.drop)
    gate = DrainGate()
    servicer = DecodeServicer(engine, receiver, args.kv_timeout, cancels, gate)

    async def on_stop() -> None:
        await cancels.stop()
        exporter.close()
        if doorbell is not None:
            doorbell.close()

    await run_worker(
        args, "decode", engine, lambda s: add_to_server(servicer, s),
        receiver.stats, on_stop, gate=gate,
    )


def _answer(doorbell: DoorbellListener, receiver: KVReceiver) -> None:
    """Commit what rang since: on the engine thread before each step, or (an engine core
    process) on the doorbell's waker thread, which sends the commits there."""
    for ring in doorbell.drain():
        receiver.ring(ring)


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
