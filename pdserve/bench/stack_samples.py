"""Where each process of a run spent its threads' time: a summary of a PDSERVE_STACK_SAMPLES folder.

    PDSERVE_STACK_SAMPLES=/tmp/stacks pdserve up ...          # or any pdserve process
    python -m pdserve.bench.stack_samples /tmp/stacks [--under 'LLMEngine.step'] [--top 12]
        [--roles prefill,decode] [--output-json summary.json]

Per process (ROLE-PID, from engine/stack_sampler.py's files): each thread's CPU seconds, then,
for each thread that used at least --min-cpu seconds, its busy samples (the stacks whose
innermost frame is not an idle wait: a selector, a condition, a queue's get, a thread pool
worker waiting for work) and the lines and functions they spent them in (functions on every
busy stack left out). A thread blocked in a C call that is not on that list (a bare
`select.select`) also counts as busy there: its CPU seconds tell. `--under TEXT` keeps only the
stacks with a frame containing TEXT (a request path, a step) before anything is counted. The
folder may be a .tgz of one.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

# innermost frames of a thread that waits: not work (the GIL's own waits cannot be seen)
IDLE = (
    "select (", "Condition.wait", "Event.wait", "_worker (futures/thread.py", "Queue.get",
    "_poll_wrapper", "_wait_for_tstate_lock", "SimpleQueue.get", "Connection.recv", "_recv",
    "wait (multiprocessing/connection.py", "Thread.join", "sleep (", "_run_commands (",
    "Thread.run (",  # innermost only when the thread's target is C (grpc's poller): blocked there
)


def _idle(frame: str) -> bool:
    return any(mark in frame for mark in IDLE)


def summarise_process(stacks: Path, under: str, top: int, min_cpu: float) -> dict[str, Any]:
    cpu = json.loads(stacks.with_suffix(".cpu.json").read_text())
    threads: dict[str, dict[str, Any]] = {}
    for line in stacks.read_text().splitlines():
        text, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = text.split(";")
        if under and not any(under in f for f in frames[1:]):
            continue
        t = threads.setdefault(frames[0], {"busy": 0, "idle": 0, "lines": collections.Counter(),
                                           "functions": collections.Counter()})
        n = int(count)
        if len(frames) < 2 or _idle(frames[-1]):
            t["idle"] += n
            continue
        t["busy"] += n
        t["lines"][frames[-1]] += n
        for function in {re.sub(r":\d+\)$", ")", f) for f in frames[1:]}:
            t["functions"][function] += n
    by_name = collections.Counter()  # CPU seconds per Python thread name (ids stripped)
    for name, seconds in cpu["threads_cpu_s"].items():
        by_name[name.rsplit(" [", 1)[0]] += seconds
    out = {"samples": cpu["samples"], "interval_s": cpu["interval_s"],
           "threads_cpu_s": cpu["threads_cpu_s"], "threads": {}}
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["busy"]):
        if by_name.get(name, 0.0) < min_cpu:  # blocked in C all along, or never ran
            continue
        out["threads"][name] = {
            "cpu_s": round(by_name.get(name, 0.0), 3), "busy_samples": t["busy"],
            "idle_samples": t["idle"], "lines": t["lines"].most_common(top),
            "functions": [(f, n) for f, n in t["functions"].most_common()
                          if n < t["busy"]][:2 * top]}  # those in every busy sample say nothing
    return out


def summarise(folder: Path, under: str = "", top: int = 12, min_cpu: float = 0.05,
              roles: set[str] | None = None) -> dict[str, Any]:
    """{ROLE-PID: summary} of every sampled process in `folder`."""
    out = {}
    for stacks in sorted(folder.rglob("*.txt")):
        if not stacks.with_suffix(".cpu.json").exists():
            continue
        if roles and stacks.stem.rsplit("-", 1)[0] not in roles:
            continue
        out[stacks.stem] = summarise_process(stacks, under, top, min_cpu)
    return out


def print_summary(summary: dict[str, Any]) -> None:
    for process, s in summary.items():
        cpu = sorted(s["threads_cpu_s"].items(), key=lambda kv: -kv[1])
        print(f"== {process}: {s['samples']} samples; CPU s by thread: "
              + ", ".join(f"{n} {c:.2f}" for n, c in cpu[:8] if c > 0))
        for name, t in s["threads"].items():
            busy = t["busy_samples"]
            print(f"  -- {name}: cpu {t['cpu_s']:.2f} s, busy {busy} / idle {t['idle_samples']} "
                  "samples")
            for line, n in t["lines"]:
                print(f"     {n / max(busy, 1):6.1%}  {line}")
            print("     functions (inclusive):")
            for function, n in t["functions"]:
                print(f"     {n / max(busy, 1):6.1%}  {function}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a PDSERVE_STACK_SAMPLES folder or a .tgz of one")
    p.add_argument("--under", default="", help="keep stacks with a frame containing this text")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--min-cpu", type=float, default=0.05, help="threads under this CPU (s) "
                   "and busy time are left out")
    p.add_argument("--roles", default="", help="comma-separated roles (the files' prefixes)")
    p.add_argument("--output-json", default="")
    args = p.parse_args(argv)
    roles = set(filter(None, args.roles.split(","))) or None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder)
        if folder.is_file():
            with tarfile.open(folder) as tar:
                tar.extractall(tmp, filter="data")
            folder = Path(tmp)
        summary = summarise(folder, args.under, args.top, args.min_cpu, roles)
    if not summary:
        print(f"no sampled processes in {args.folder}", file=sys.stderr)
        return 1
    print_summary(summary)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
