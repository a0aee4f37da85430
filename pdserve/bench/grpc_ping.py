"""gRPC's own round trip between two processes, each way apart: the ceiling of a Prefill's way
there and back (`pdserve.bench.ttft_breakdown`'s prefill_call_there / _back), as a unary call
of its own or as a message each way on a call kept open (a gateway's PrefillStreams call).

    python -m pdserve.bench.grpc_ping [--calls 400] [--payload-bytes 4000] [--gap-ms 5]
        [--modes unary,stream]

A server process runs pdserve's grpc.aio server (`make_server`: its options and interceptors)
with a unary method and a bidirectional streaming one, each answering (per message) the time
it was called (time.monotonic: one clock for the host's processes); the client, in this
process, opens one streaming call, then sends `--calls` rounds over `open_channel`, each a
unary call and a message on the open call in turn (`--modes`), `--gap-ms` of idle before each
(as a request at 16 req/s finds the workers), and splits each round trip into there (its send
to the handler) and back (the handler to the answer). Prints the medians and p90s in ms per
mode.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.synchronize
import sys
import time
from collections.abc import AsyncIterator

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

    async def pings(requests: AsyncIterator[bytes],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield repr(time.monotonic()).encode()

    def add(server: grpc.aio.Server) -> None:
        handlers = {"Ping": grpc.unary_unary_rpc_method_handler(ping, _raw, _raw),
                    "Pings": grpc.stream_stream_rpc_method_handler(pings, _raw, _raw)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),))

    server, _ = await make_server(SERVICE, add, [DrainGate()])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _server_main(port: int, ready: multiprocessing.synchronize.Event) -> None:
    asyncio.run(_serve(port, ready))


async def _calls(port: int, calls: int, payload: bytes, gap_s: float,
                 modes: list[str]) -> dict:
    channel = open_channel(f"127.0.0.1:{port}")
    ping = channel.unary_unary(f"/{SERVICE}/Ping", request_serializer=_raw,
                               response_deserializer=_raw)
    stream = channel.stream_stream(f"/{SERVICE}/Pings", request_serializer=_raw,
                                   response_deserializer=_raw)(timeout=None)

    async def on_stream(message: bytes) -> bytes:
        await stream.write(message)
        return await stream.read()

    ask = {"unary": lambda m: ping(m, timeout=10), "stream": on_stream}
    for _ in range(20):  # the connection, the first calls' allocations
        for mode in modes:
            await ask[mode](payload)
    parts: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode in modes}
    for _ in range(calls):
        for mode in modes:
            await asyncio.sleep(gap_s)
            sent = time.monotonic()
            handled = float(await ask[mode](payload))
            answered = time.monotonic()
            parts[mode][0].append(handled - sent)
            parts[mode][1].append(answered - handled)
    await stream.done_writing()
    await channel.close()
    return {mode: {name: {f"p{q}": round(1e3 * percentile(v, q), 3) for q in (50, 90)}
                   for name, v in (("there", there), ("back", back),
                                   ("round_trip", [a + b for a, b in zip(there, back)]))}
            for mode, (there, back) in parts.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--payload-bytes", type=int, default=4000,
                   help="the request's size (a Prefill of ~1000 prompt tokens: ~4 kB)")
    p.add_argument("--gap-ms", type=float, default=5.0, help="idle time between two calls")
    p.add_argument("--modes", default="unary,stream",
                   help="comma list: unary (a call each), stream (a message each way on a call "
                        "kept open); the modes take turns")


def run(args: argparse.Namespace) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.calls < 1 or args.payload_bytes < 0 or args.gap_ms < 0:
        raise ValueError("--calls must be >= 1, --payload-bytes and --gap-ms >= 0")
    if not modes or set(modes) - {"unary", "stream"}:
        raise ValueError("--modes is a comma list of unary, stream")
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_server_main, args=(port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the ping server did not start in 60 s")
        result = asyncio.run(_calls(port, args.calls, b"x" * args.payload_bytes,
                                    args.gap_ms / 1e3, modes))
    finally:
        server.kill()
        server.join()
    for mode, parts in result.items():
        print(f"grpc {mode} (ms): " + ", ".join(f"{k} p50 {v['p50']} p90 {v['p90']}"
                                                for k, v in parts.items()))
    return result


def main(argv: list[str] | None = None) -> int:
    return bench_main("grpc_ping", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
