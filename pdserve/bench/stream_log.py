"""A gateway's cost of recording its streams in Redis (gateway/recorder.py,
pdserve/cluster/log_writer.py).

    python -m pdserve.bench.stream_log [--streams 32] [--steps 300] [--step-ms 5] [--rounds 5]
        [--write-interval-ms 10] [--redis-server redis-server]

NOTE: a gateway records every streamed SSE event for resuming. Here `--streams` streams get an
output each per step, every `--step-ms` (a decode step), for `--steps` steps; each renders it
as a ~300-byte SSE event the way the gateway's stream does (`tap` -> view -> `record`), either
recorded (`recorded`: the gateway's StreamRecorder and its log writer, its calls
--write-interval-ms apart at least as the gateway's --resume-write-interval-ms, against a Redis
of --redis-server on a free port) or only numbered (`unrecorded`: a gateway without a log). The
difference is what recording costs. Reported per mode and round (alternating, after a warm-up
round of each): this process's CPU microseconds per event (user + system, the pacing's idle
loop included in both) and the wall time per step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from gateway.recorder import StreamRecorder, numbered
from gateway.sequence import SequenceOutput
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.cluster.event_log import EventLog
from pdserve.cluster.state import connect

MODES = ("recorded", "unrecorded")
EVENT = "data: " + "x" * 290 + "\n\n"


async def _outputs(queue: asyncio.Queue) -> AsyncGenerator[SequenceOutput, None]:
    while (out := await queue.get()) is not None:
        yield out


async def _view(outputs: AsyncGenerator[SequenceOutput, None]) -> AsyncGenerator[str, None]:
    async for _ in outputs:
        yield EVENT


def _stream(log: EventLog, request_id: str, queue: asyncio.Queue,
            mode: str) -> AsyncGenerator[str, None]:
    if mode == "unrecorded":
        return numbered(_view(_outputs(queue)))
    recorder = StreamRecorder(log, request_id, spec="{}")
    return recorder.record(_view(recorder.tap(_outputs(queue))))


async def one_round(log: EventLog, args: argparse.Namespace, tag: str,
                    mode: str) -> tuple[float, float]:
    """(CPU us per event, wall ms per step)."""
    queues = [asyncio.Queue() for _ in range(args.streams)]
    sent, step_sent = [0], asyncio.Event()

    async def client(i: int) -> None:
        async for _ in _stream(log, f"{tag}-{i}", queues[i], mode):
            sent[0] += 1
            if sent[0] == args.streams:
                step_sent.set()

    clients = [asyncio.create_task(client(i)) for i in range(args.streams)]
    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(args.steps):
        sent[0] = 0
        step_sent.clear()
        for q in queues:
            q.put_nowait(SequenceOutput(0, " tok", [step]))
        await step_sent.wait()
        await asyncio.sleep(args.step_ms / 1e3)
    for q in queues:
        q.put_nowait(None)
    await asyncio.gather(*clients)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return 1e6 * cpu / (args.streams * args.steps), 1e3 * wall / args.steps


async def measure(url: str, args: argparse.Namespace) -> dict[str, list[list[float]]]:
    client = connect(url)
    log = EventLog(client, "stream-log-bench", ttl_s=60, lease_ms=30000,
                   write_interval_s=args.write_interval_ms / 1e3)
    results: dict[str, list[list[float]]] = {m: [] for m in MODES}
    try:
        for r in range(args.rounds + 1):
            for mode in MODES:
                got = await one_round(log, args, f"{mode}{r}", mode)
                if r:  # round 0 warms up
                    results[mode].append([round(x, 2) for x in got])
                    print(f"round {r}  {mode:10s} {got[0]:7.1f} CPU us an event, "
                          f"{got[1]:6.2f} ms a step")
    finally:
        await client.aclose()
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=32, help="streams sending at once")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-ms", type=float, default=5.0, help="pause between steps")
    p.add_argument("--rounds", type=int, default=5, help="per mode, after a warm-up")
    p.add_argument("--write-interval-ms", type=float, default=10.0,
                   help="the log writer's least time between calls (the gateway's default)")
    p.add_argument("--redis-server", default="redis-server", help="the binary")
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import subprocess

    from pdserve.bench.gpu_serve import start_redis, stop

    if min(args.streams, args.steps, args.rounds) < 1 or args.step_ms < 0:
        raise ValueError("--streams, --steps and --rounds must be >= 1, --step-ms >= 0")
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            url = start_redis(args.redis_server, Path(tmp), subprocess.DEVNULL, procs)
            rounds = asyncio.run(measure(url, args))
        finally:
            stop(procs)
    medians = {m: {"cpu_us_per_event": statistics.median(r[0] for r in v),
                   "ms_per_step": statistics.median(r[1] for r in v)} for m, v in rounds.items()}
    for m, v in medians.items():
        print(f"median   {m:10s} {v['cpu_us_per_event']:7.1f} CPU us an event, "
              f"{v['ms_per_step']:6.2f} ms a step")
    cost = medians["recorded"]["cpu_us_per_event"] - medians["unrecorded"]["cpu_us_per_event"]
    print(f"recording: {cost:.1f} CPU us an event")
    report = {"config": config_of(args), "rounds": rounds, "medians": medians,
              "recording_cpu_us_per_event": round(cost, 2)}
    if args.output_json:
        write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("stream_log", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
