"""Raw grpcio's rate for one client stream by the pattern of its message sizes.

    python -m pdserve.bench.grpc_message_sizes [--rounds 3] [--mib 256]

NOTE: the grpc KV push cuts a request's KV into slabs of at most `--kv-slab-bytes`; a layer
larger than a slab used to go as full slabs and a remainder (the bundled model's shape at 5824
tokens and 4 MiB: 4.18, 4.18 and 0.61 MB per layer). Those messages moved at about half the
rate of the same bytes in even messages, on the same stream to the same sink that only counts
them (`pdserve.bench.transfer`'s raw sink, a child process, loopback), so the push now cuts a
layer into even pieces (engine/kv_transfer.py `even_piece`). This replays each pattern (random
bytes, pre-made messages, no serializer), the patterns in turn each round, and prints GiB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.transfer import RAW_METHOD
from pdserve.cluster.grpc_server import GRPC_OPTIONS
from pdserve.ports import free_port

# per layer of the bundled model's KV at 5824 tokens (8.76 MB a layer), in each cutting
PATTERNS = {
    "4 MiB, 4 MiB, rest 0.6 MiB": [4177937, 4177940, 614418],
    "even thirds, 2.9 MiB": [2920098],
    "4 MiB fixed": [4194304],
    "2 MiB x4, rest 0.6 MiB": [2088978, 2088974, 2088977, 2088978, 614418],
    "even fifths, 1.75 MiB": [1752059],
    "2 MiB fixed": [2097152],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256, help="bytes per stream (about)")
    parser.add_argument("--output-json", default="bench_results/grpc_message_sizes.json")


def messages(source: bytes, sizes: list[int], total: int) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < total:
        size = sizes[i % len(sizes)]
        out.append(source[pos:pos + size])
        pos, i = pos + size, i + 1
    return out


async def measure(args: argparse.Namespace, port: int) -> dict[str, list[float]]:
    total = args.mib << 20
    source = os.urandom(total + (8 << 20))
    rates: dict[str, list[float]] = {name: [] for name in PATTERNS}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
        await asyncio.wait_for(ch.channel_ready(), 60)
        push = ch.stream_unary(RAW_METHOD)
        for r in range(args.rounds):
            for name, sizes in PATTERNS.items():
                msgs = messages(source, sizes, total)

                async def stream(msgs: list[bytes] = msgs) -> AsyncIterator[bytes]:
                    for m in msgs:
                        yield m

                start = time.perf_counter()
                await push(stream())
                rate = sum(map(len, msgs)) / (time.perf_counter() - start) / 2**30
                rates[name].append(rate)
                print(f"round {r}: {name:>28}: {len(msgs):4d} messages, {rate:.2f} GiB/s",
                      flush=True)
    return rates


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    sink = subprocess.Popen([sys.executable, "-c",
                             f"from pdserve.bench.transfer import serve_raw; serve_raw({port})"])
    try:
        rates = asyncio.run(measure(args, port))
    finally:
        sink.kill()
        sink.wait()
    report = {"config": config_of(args), "gib_per_s": rates,
              "median_gib_per_s": {k: statistics.median(v) for k, v in rates.items()}}
    print("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in report["median_gib_per_s"].items()))
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("grpc_message_sizes", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
