"""Where engine processes stalled: the longest steps, the longest gaps between steps and the
garbage collections of each process's step timeline (engine/step_timeline.py).

    PDSERVE_STEP_TIMELINE=DIR bash pdserve/bench/gpu_kit_run.sh ...   # then:
    python -m pdserve.bench.step_gaps DIR [--top 5] [--min-gc-ms 1] [--buckets 40-60,90-1000]
                                          [--window FROM-TO] [--brief]

A gap is the time from one step's end to the next one's start: the process was doing something
else (its commands, outputs, a collection) or had nothing to do. Per bucket of a step's outputs
(a decode step's: its running streams), the median step and the median period (one step's
start to the next one's): how fast the process stepped at that batch, to set beside another
process's at the same batch (a colocated engine's against the split's decode worker's); and,
where the timeline has them, the median of each step's device wait and of its host time (the
step less that wait) and its loop thread's CPU: a slow period with a long wait is the GPU's,
one with a long host time the host's (and its CPU says whether the host ran or was off). Times
are in milliseconds from the first step of any process in DIR (one clock for every process of a
host); `--window FROM-TO` keeps only the steps starting in that span of them (a burst's
prefill, to count the decode steps beside it) and adds each process's time in steps and in
device waits there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def by_outputs(steps: list[list[float]], lo: int, hi: int) -> dict[str, Any]:
    """The steps with lo <= outputs <= hi: how many, their median duration and period (ms;
    a period only where a step follows); with steps of five fields [start, s, outputs, wait,
    cpu] also the medians of the wait, the host's part (s - wait) and the CPU."""
    picked = [i for i, s in enumerate(steps) if lo <= s[2] <= hi]
    periods = [steps[i + 1][0] - steps[i][0] for i in picked if i + 1 < len(steps)]
    p50 = lambda values: round(1e3 * statistics.median(values), 2)  # noqa: E731
    result = {"outputs": [lo, hi], "steps": len(picked),
              "step_ms_p50": p50(steps[i][1] for i in picked) if picked else None,
              "period_ms_p50": p50(periods) if periods else None}
    timed = [steps[i] for i in picked if len(steps[i]) >= 5]
    if timed:
        result.update(wait_ms_p50=p50(s[3] for s in timed),
                      host_ms_p50=p50(s[1] - s[3] for s in timed),
                      cpu_ms_p50=p50(s[4] for s in timed))
    return result


def summarize(timeline: dict[str, Any], origin: float, top: int, min_gc_ms: float,
              buckets: tuple[tuple[int, int], ...] = (),
              window: tuple[float, float] | None = None) -> dict[str, Any]:
    steps = timeline["steps"]
    ms = lambda t: round(1e3 * (t - origin), 1)  # noqa: E731
    extra = {}
    if window is not None:
        steps = [s for s in steps if window[0] <= 1e3 * (s[0] - origin) < window[1]]
        extra = {"window_ms": list(window),
                 "in_steps_ms": round(1e3 * sum(s[1] for s in steps), 1),
                 "waiting_ms": round(1e3 * sum(s[3] for s in steps if len(s) >= 5), 1)}
    longest = sorted(steps, key=lambda s: -s[1])[:top]
    gaps = [(a[0] + a[1], b[0] - (a[0] + a[1])) for a, b in zip(steps, steps[1:])]
    widest = sorted(gaps, key=lambda g: -g[1])[:top]
    return {
        "role": timeline["role"], "pid": timeline["pid"], "steps": len(steps),
        "span_ms": [ms(steps[0][0]), ms(steps[-1][0] + steps[-1][1])] if steps else None,
        "longest_steps": [{"at_ms": ms(s[0]), "ms": round(1e3 * s[1], 2), "outputs": s[2],
                           **({"wait_ms": round(1e3 * s[3], 2)} if len(s) >= 5 else {})}
                          for s in longest],
        "widest_gaps": [{"at_ms": ms(t), "ms": round(1e3 * g, 2)} for t, g in widest],
        "collections": [{"at_ms": ms(t), "ms": round(1e3 * s, 2), "generation": g}
                        for t, s, g in timeline["gc"] if 1e3 * s >= min_gc_ms],
        "by_outputs": [by_outputs(steps, lo, hi) for lo, hi in buckets], **extra,
    }


def brief_lines(summaries: list[dict[str, Any]]) -> list[str]:
    """`role pid outputs LO-HI: N steps, key value ...` for every process with steps."""
    lines = []
    for summary in summaries:
        if "window_ms" in summary:
            lo, hi = summary["window_ms"]
            lines.append(f"{summary['role']} {summary['pid']} window {lo:g}-{hi:g} ms: "
                         f"{summary['steps']} steps, {summary['in_steps_ms']} ms in steps, "
                         f"{summary['waiting_ms']} ms waiting")
        for bucket in summary["by_outputs"] if summary["steps"] else ():
            lo, hi = bucket["outputs"]
            rest = " ".join(f"{k.removesuffix('_p50')} {v}" for k, v in bucket.items()
                            if k not in ("outputs", "steps"))
            lines.append(f"{summary['role']} {summary['pid']} outputs {lo}-{hi}: "
                         f"{bucket['steps']} steps {rest}")
    return lines


def parse_window(text: str) -> tuple[float, float]:
    """"7550-7760" -> (7550.0, 7760.0). Raises ValueError."""
    lo, sep, hi = text.partition("-")
    try:
        window = (float(lo), float(hi))
    except ValueError:
        window = None
    if not sep or window is None or window[0] >= window[1]:
        raise ValueError(f"--window: {text!r} is not FROM-TO (ms, FROM < TO)")
    return window


def parse_buckets(text: str) -> tuple[tuple[int, int], ...]:
    """"40-60,90-1000" -> ((40, 60), (90, 1000)). Raises ValueError."""
    buckets = []
    for part in filter(None, text.split(",")):
        lo, sep, hi = part.partition("-")
        if not sep or not lo.isdigit() or not hi.isdigit() or int(lo) > int(hi):
            raise ValueError(f"--buckets: {part!r} is not LO-HI (outputs, LO <= HI)")
        buckets.append((int(lo), int(hi)))
    return tuple(buckets)


def report(folder: Path, top: int = 5, min_gc_ms: float = 1.0,
           buckets: tuple[tuple[int, int], ...] = (),
           window: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    timelines = [json.loads(p.read_text()) for p in sorted(folder.glob("*.timeline.json"))]
    starts = [t["steps"][0][0] for t in timelines if t["steps"]]
    if not starts:
        raise ValueError(f"no steps in {folder}/*.timeline.json")
    origin = min(starts)
    return [summarize(t, origin, top, min_gc_ms, buckets, window) for t in timelines]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.step_gaps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--min-gc-ms", type=float, default=1.0)
    p.add_argument("--buckets", default="1-8,40-60,90-1000",
                   help="ranges of a step's outputs, LO-HI, comma-separated")
    p.add_argument("--window", default=None, metavar="FROM-TO",
                   help="only the steps starting in this span (ms from the first step)")
    p.add_argument("--brief", action="store_true",
                   help="one line per process and bucket (the by-outputs medians) instead of "
                        "the JSON")
    args = p.parse_args(argv)
    try:
        buckets = parse_buckets(args.buckets)
        window = None if args.window is None else parse_window(args.window)
        summaries = report(args.folder, args.top, args.min_gc_ms, buckets, window)
        print("\n".join(brief_lines(summaries)) if args.brief
              else json.dumps(summaries, indent=1))
    except ValueError as exc:
        print(f"step_gaps: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
