"""Which process of a local cluster runs out of CPU under load: each matching process's CPU use,
sampled from /proc every interval until SIGTERM / SIGINT (Linux).

    python -m pdserve.bench.proc_cpu --match pdserve --out cpu.json [--interval 0.5] &
    ... the load ...; kill %1

Every interval it reads utime + stime of each process whose command line contains --match (or
one of its comma-separated parts: `pdserve,engine.core_process` takes the engine core too)
(`/proc/PID/stat`, `/proc/PID/cmdline`) and records the CPU share since the previous sample
(1.0 = one core busy the whole interval), and the whole machine's busy and stolen cores
(`/proc/stat`'s first line: every process, matching or not; steal is time a virtual machine's
CPUs waited for the host). The JSON: `processes` {pid: command line}, `cpus`
(os.cpu_count()), `started_unix` and `samples` [{t, cpu: {pid: share}, machine: {busy,
steal}}] (t: seconds since `started_unix`); `busiest` lists, per process, its samples' 90th
percentile and maximum: a process near 1.0 for a stretch (one Python thread holds the GIL; its
other threads barely add) is what bounds the cluster then.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: str) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)


def matching(pattern: str) -> dict[str, str]:
    """{pid: command line} of the processes whose command line contains `pattern` (or one of
    its comma-separated parts), not this."""
    parts = [p for p in pattern.split(",") if p]
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name == str(os.getpid()):
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if any(part in cmd for part in parts):
            found[entry.name] = cmd[:200]
    return found


def machine_ticks() -> tuple[int, int]:
    """(busy, steal) clock ticks of all CPUs since boot (/proc/stat's `cpu` line: user
    nice system idle iowait irq softirq steal ...; idle and iowait are not busy)."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields[:8]) - fields[3] - fields[4] - steal, steal


def children(pid: int, pattern: str) -> list[int]:
    """The processes whose parent is `pid` and whose command line contains `pattern` (an
    engine core process of a server)."""
    found = []
    for child in matching(pattern):
        try:
            ppid = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(child))
    return found


def sample(pattern: str, interval: float) -> dict[str, Any]:
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    processes: dict[str, str] = {}
    samples: list[dict[str, Any]] = []
    last: dict[str, float] = {}
    last_t, start, started_unix = time.monotonic(), time.monotonic(), time.time()
    last_machine = machine_ticks()
    while not stop:
        time.sleep(interval)
        now = time.monotonic()
        current = matching(pattern)
        processes.update(current)
        shares = {}
        for pid in current:
            secs = cpu_seconds(pid)
            if secs is None:
                continue
            if pid in last:
                shares[pid] = round((secs - last[pid]) / (now - last_t), 3)
            last[pid] = secs
        machine = machine_ticks()
        busy, steal = ((m - p) / TICKS / (now - last_t)
                       for m, p in zip(machine, last_machine, strict=True))
        samples.append({"t": round(now - start, 3), "cpu": shares,
                        "machine": {"busy": round(busy, 2), "steal": round(steal, 2)}})
        last_t, last_machine = now, machine
    return {"interval_s": interval, "started_unix": started_unix, "cpus": os.cpu_count(),
            "processes": processes, "samples": samples, "busiest": busiest(samples)}


def busiest(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    per: dict[str, list[float]] = {}
    for s in samples:
        for pid, share in s["cpu"].items():
            per.setdefault(pid, []).append(share)
    return {pid: {"p90": sorted(v)[int(0.9 * (len(v) - 1))], "max": max(v), "samples": len(v)}
            for pid, v in per.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.proc_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", default="pdserve,engine.core_process",
                   help="substrings of the command lines, comma-separated")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--out", required=True, help="JSON file written on SIGTERM / SIGINT")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    result = sample(args.match, args.interval)
    Path(args.out).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
