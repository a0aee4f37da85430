"""What listing the worker registry costs as the Redis namespace fills with requests' keys.

    python -m pdserve.bench.registry_listing [--keys 0,500,3000,20000] [--repeats 50]

NOTE: a split cluster's gateway lists the registry for every request it routes, and every
request leaves ~4 keys in the namespace for up to an hour (its state, its resumable stream's
events). On a throw-away redis-server (launched as `pdserve up` launches one), 4 registered
workers and `--keys` other keys, the ms a listing takes: through the registry's index
(`WorkerRegistry.list_workers`) against the peer in the same run, a SCAN of the key pattern
and an MGET (the listing before the index, `scan_keys`).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.cluster.registry import WorkerInfo, WorkerRegistry
from pdserve.cluster.state import connect
from pdserve.launcher import Service, redis_argv, stop_all, wait_healthy
from pdserve.ports import free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", default="0,500,3000,20000",
                        help="other keys in the namespace, comma-separated counts")
    parser.add_argument("--repeats", type=int, default=50, help="listings timed per count")
    parser.add_argument("--output-json", default="bench_results/registry_listing.json")


async def _timed(repeats: int, listing: Any) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        workers = await listing()
    assert len(workers) == 4, workers
    return (time.perf_counter() - start) / repeats * 1e3


async def measure(url: str, counts: list[int], repeats: int) -> list[dict[str, float]]:
    client = connect(url)
    registry = WorkerRegistry(client)
    for role in ("prefill", "decode"):
        for i in range(2):
            await registry.register(WorkerInfo(f"{role[0]}{i}", role, f"127.0.0.1:{5000 + i}"))

    async def scanned() -> list[str | None]:
        keys = await registry.scan_keys()
        return await client.mget(keys)

    rows, held = [], 0
    for count in counts:
        async with client.pipeline(transaction=False) as pipe:
            for i in range(held, count):
                pipe.set(f"pdserve:request:r{i}", "{}", ex=600)
            await pipe.execute()
        held = max(held, count)
        index_ms = await _timed(repeats, registry.list_workers)
        scan_ms = await _timed(repeats, scanned)
        rows.append({"other_keys": held, "index_ms": index_ms, "scan_ms": scan_ms})
        print(f"{held:7d} other keys: listing {index_ms:.2f} ms through the index, "
              f"{scan_ms:.2f} ms by SCAN ({scan_ms / index_ms:.1f}x)", flush=True)
    await client.aclose()
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted(int(c) for c in args.keys.split(","))
    if not counts or counts[0] < 0 or args.repeats < 1:
        raise ValueError("--keys: counts >= 0; --repeats >= 1")
    port = free_port()
    redis = Service("redis", redis_argv(port), f"redis:{port}")
    redis.proc = subprocess.Popen(redis.argv, stdout=subprocess.DEVNULL)
    try:
        wait_healthy(redis, time.monotonic() + 30)
        report = {"config": config_of(args), "rows": asyncio.run(
            measure(f"redis://127.0.0.1:{port}/0", counts, args.repeats))}
        write_report(report, args.output_json)
        return report
    finally:
        stop_all([redis])


def main(argv: list[str] | None = None) -> int:
    return bench_main("registry_listing", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
