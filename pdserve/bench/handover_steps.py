"""A decode engine's steps, phase by phase, from the handover trace in a cluster's log.

    PDSERVE_HANDOVER_TRACE=1 ... (the decode worker's log: pdserve up's output)
    python -m pdserve.bench.handover_steps CLUSTER_LOG [--window-ms 100] [--since-s 0]

NOTE: the decode engine stamps every step it runs while a traced request waits for its first
tokens (engine/handover_trace.py): `step` (the step begins), `scheduled`, `launched` (its
forward and sampling are queued on the device), `landed` (the previous step's tokens are on the
host: with async scheduling the host waits for step N-1 after launching step N), `sampling`.
Each traced request's line holds the stamps of the steps it saw; here each step's phases are

    schedule  step -> scheduled          the scheduler
    launch    scheduled -> launched      inputs packed and copied, the forward's launches
    land      launched -> landed         waiting for the device (the previous step's tokens)
    sample    landed -> sampling
    after     sampling -> the next step  outputs made and sent, the commands between steps

and the medians per --window-ms window are printed from the first step on (or from
--since-s seconds after it), with the count of step records in each (a step seen by several
traced requests counts once per request: the medians weigh such steps more).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from pdserve.bench.report import bench_main

PHASES = ("scheduled", "launched", "landed", "sampling")
_LINE = re.compile(r"handover \[[^\]]+\] commit_in=([0-9.]+)(.*)")
_STAMP = re.compile(r"(\w+)=\+([0-9.]+)")


def step_records(text: str) -> list[tuple[float, tuple[float, ...]]]:
    """(step start s, (schedule, launch, land, sample, after) ms) for every step a traced
    request saw followed by another it saw."""
    records = []
    for line in text.splitlines():
        m = _LINE.search(line)
        if m is None or "step=" not in line:
            continue
        t0, steps = float(m.group(1)), []
        for name, offset in _STAMP.findall(m.group(2)):
            t = t0 + float(offset) / 1e3
            if name == "step":
                steps.append({"step": t})
            elif steps and name in PHASES:
                steps[-1][name] = t
        for a, b in zip(steps, steps[1:]):
            if all(p in a for p in PHASES):
                marks = [a["step"], *(a[p] for p in PHASES), b["step"]]
                records.append((a["step"], tuple(1e3 * (y - x) for x, y in zip(marks, marks[1:]))))
    return sorted(records)


def windows(records: list[tuple[float, tuple[float, ...]]], window_ms: float,
            since_s: float = 0.0) -> list[dict]:
    if not records:
        raise ValueError("no handover trace with steps in the log (PDSERVE_HANDOVER_TRACE=1?)")
    start = records[0][0] + since_s
    groups: dict[int, list[tuple[float, ...]]] = {}
    for t, phases in records:
        if t >= start:
            groups.setdefault(int(round((t - start) * 1e3, 6) // window_ms), []).append(phases)
    rows = []
    for i in sorted(groups):
        g = groups[i]
        med = [round(statistics.median(p[k] for p in g), 2) for k in range(5)]
        rows.append({"t_ms": round(i * window_ms), "records": len(g),
                     **dict(zip(("schedule", "launch", "land", "sample", "after"), med)),
                     "step": round(sum(med), 2)})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", type=Path, help="the cluster's log (pdserve up's output)")
    p.add_argument("--window-ms", type=float, default=100.0)
    p.add_argument("--since-s", type=float, default=0.0,
                   help="start this many seconds after the first traced step")


def run(args: argparse.Namespace) -> list[dict]:
    if args.window_ms <= 0:
        raise ValueError("--window-ms must be positive")
    rows = windows(step_records(args.log.read_text(errors="replace")), args.window_ms,
                   args.since_s)
    print("    t ms  records  schedule  launch   land  sample  after   step (ms, medians)")
    for r in rows:
        print(f"{r['t_ms']:8d}  {r['records']:7d}  {r['schedule']:8.2f}  {r['launch']:6.2f}"
              f"  {r['land']:5.2f}  {r['sample']:6.2f}  {r['after']:5.2f}  {r['step']:5.2f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    return bench_main("handover_steps", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
