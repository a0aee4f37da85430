"""A gateway's cost of recording its streams in Redis (pdserve/cluster/event_log.py).

    python -m pdserve.bench.stream_log [--streams 24] [--steps 200] [--rounds 3]
        [--redis-server redis-server]

NOTE: a gateway records every streamed SSE event for resuming: each stream's writer appends
what a decode step gave it. Here `--streams` writers append one ~300-byte event each per step,
all at once, for `--steps` steps, against a Redis of --redis-server on a free port, with the
appends of a gateway grouped into one script call per round trip (`grouped`, EventLog's way)
and with one call per append, all at once (`apart`: each stream's round trip its own, as before
the grouping: every append gets its connection from the client's pool). Reported per
mode and round (alternating, after a warm-up round of each): this process's CPU microseconds
per append (user + system) and the wall time per step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.cluster.event_log import EventLog, LogEvent
from pdserve.cluster.state import connect

MODES = ("grouped", "apart")
EVENT = "data: " + "x" * 290 + "\n\n"


async def apart(log: EventLog, rid: str, event: LogEvent) -> bool:
    """One append in a script call of its own (EventLog's call for a batch of one)."""
    return bool((await log._append_many([(rid, "me", [event], "", None)]))[0])


async def one_round(log: EventLog, streams: int, steps: int, tag: str,
                    mode: str) -> tuple[float, float]:
    """(CPU us per append, wall ms per step)."""
    ids = [f"{tag}-{i}" for i in range(streams)]
    for rid in ids:
        await log.open(rid, "me", "{}")
    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(steps):
        events = [LogEvent(step, EVENT, "[]")]
        ok = await asyncio.gather(*(log.append(rid, "me", events) if mode == "grouped" else
                                    apart(log, rid, events[0]) for rid in ids))
        if not all(ok):
            raise RuntimeError("an append lost its lease")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return 1e6 * cpu / (streams * steps), 1e3 * wall / steps


async def measure(url: str, args: argparse.Namespace) -> dict[str, list[list[float]]]:
    client = connect(url)
    log = EventLog(client, "stream-log-bench", ttl_s=60, lease_ms=30000)
    results: dict[str, list[list[float]]] = {m: [] for m in MODES}
    try:
        for r in range(args.rounds + 1):
            for mode in MODES:
                got = await one_round(log, args.streams, args.steps, f"{mode}{r}", mode)
                if r:  # round 0 warms up
                    results[mode].append([round(x, 2) for x in got])
                    print(f"round {r}  {mode:8s} {got[0]:7.1f} CPU us an append, "
                          f"{got[1]:6.2f} ms a step")
    finally:
        await client.aclose()
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=24, help="writers appending at once")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="per mode, after a warm-up")
    p.add_argument("--redis-server", default="redis-server", help="the binary")
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import subprocess

    from pdserve.bench.gpu_serve import start_redis, stop

    if min(args.streams, args.steps, args.rounds) < 1:
        raise ValueError("--streams, --steps and --rounds must be >= 1")
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            url = start_redis(args.redis_server, Path(tmp), subprocess.DEVNULL, procs)
            rounds = asyncio.run(measure(url, args))
        finally:
            stop(procs)
    medians = {m: {"cpu_us_per_append": statistics.median(r[0] for r in v),
                   "ms_per_step": statistics.median(r[1] for r in v)} for m, v in rounds.items()}
    for m, v in medians.items():
        print(f"median   {m:8s} {v['cpu_us_per_append']:7.1f} CPU us an append, "
              f"{v['ms_per_step']:6.2f} ms a step")
    report = {"config": config_of(args), "rounds": rounds, "medians": medians}
    if args.output_json:
        write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("stream_log", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
