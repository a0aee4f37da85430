"""gRPC's own unary round trip between two processes, each way apart: the ceiling of a Prefill
call's way there and back (`pdserve.bench.ttft_breakdown`'s prefill_call_there / _back).

    python -m pdserve.bench.grpc_ping [--calls 400] [--payload-bytes 4000] [--gap-ms 5]

A server process runs pdserve's grpc.aio server (`make_server`: its options and interceptors)
with one unary method that answers the time it was called (time.monotonic: one clock for the
host's processes); the client, in this process, calls it over `open_channel` `--calls` times,
`--gap-ms` apart (idle between calls, as a request at 16 req/s finds the workers), and splits
each call into there (its send to the handler) and back (the handler to the answer). Prints
the medians and p90s in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.synchronize
import sys
import time

import grpc

from loadtest.metrics import percentile
from pdserve.bench.report import bench_main
from pdserve.cluster.drain import DrainGate
from pdserve.cluster.grpc_server import make_server, open_channel
from pdserve.ports import free_port

SERVICE = "pdserve.bench.Ping"


def _raw(x: bytes) -> bytes:
    return x


async def _serve(port: int, ready: multiprocessing.synchronize.Event) -> None:
    async def ping(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return repr(time.monotonic()).encode()

    def add(server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(ping, _raw, _raw)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Ping": handler}),))

    server, _ = await make_server(SERVICE, add, [DrainGate()])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _server_main(port: int, ready: multiprocessing.synchronize.Event) -> None:
    asyncio.run(_serve(port, ready))


async def _calls(port: int, calls: int, payload: bytes, gap_s: float) -> dict:
    channel = open_channel(f"127.0.0.1:{port}")
    ping = channel.unary_unary(f"/{SERVICE}/Ping", request_serializer=_raw,
                               response_deserializer=_raw)
    for _ in range(20):  # the connection, the first calls' allocations
        await ping(payload, timeout=10)
    there, back = [], []
    for _ in range(calls):
        sent = time.monotonic()
        handled = float(await ping(payload, timeout=10))
        answered = time.monotonic()
        there.append(handled - sent)
        back.append(answered - handled)
        await asyncio.sleep(gap_s)
    await channel.close()
    return {name: {f"p{q}": round(1e3 * percentile(v, q), 3) for q in (50, 90)}
            for name, v in (("there", there), ("back", back),
                            ("round_trip", [a + b for a, b in zip(there, back)]))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--payload-bytes", type=int, default=4000,
                   help="the request's size (a Prefill of ~1000 prompt tokens: ~4 kB)")
    p.add_argument("--gap-ms", type=float, default=5.0, help="idle time between two calls")


def run(args: argparse.Namespace) -> dict:
    if args.calls < 1 or args.payload_bytes < 0 or args.gap_ms < 0:
        raise ValueError("--calls must be >= 1, --payload-bytes and --gap-ms >= 0")
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_server_main, args=(port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the ping server did not start in 60 s")
        result = asyncio.run(_calls(port, args.calls, b"x" * args.payload_bytes,
                                    args.gap_ms / 1e3))
    finally:
        server.kill()
        server.join()
    print("grpc unary (ms): " + ", ".join(f"{k} p50 {v['p50']} p90 {v['p90']}"
                                          for k, v in result.items()))
    return result


def main(argv: list[str] | None = None) -> int:
    return bench_main("grpc_ping", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
