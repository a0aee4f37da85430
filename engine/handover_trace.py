"""PDSERVE_HANDOVER_TRACE=1: stamp a decode worker's committed requests on their way from the
KV commit into the decode batch and out as tokens, and log the stamps once the request's second
token leaves. For finding where a handover's milliseconds go; off (one bool test) otherwise.

Stamps are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for every process of a
host), so a log line lines up with the prefill worker's or a benchmark's stamps. The log line:

    handover [request] commit_in=T0 commit_run=+ms step=+ms ... yield=+ms ...

`commit_in` the PushKV commit read by the receiver, `commit_run` the engine thread committing it,
`step` each engine step begun while the request waits for its tokens (inside it `scheduled`,
`launched`, `landed`: the previous step's tokens waited for, `sampling`; `step_out` when one
returned outputs for it), `yield` each Generate message with its tokens handed to gRPC.

With the decode engine in a process of its own (decode_svc/engine_core.py) that process logs a
line of its own for the request: `commit_in` the commit command read there, `commit_run`, the
steps, and `yield` each step's outputs sent to the worker's process. A reader merges the lines
of one request id (`merge`).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

TRACE = os.environ.get("PDSERVE_HANDOVER_TRACE") == "1"
YIELDS = 2  # messages to stamp before the line is logged

_marks: dict[str, list[tuple[str, float]]] = {}


def mark(request_id: str, phase: str) -> None:
    """Stamp `phase` now; `commit_in` starts a request's stamps."""
    if not TRACE:
        return
    if phase == "commit_in":
        _marks[request_id] = []
    stamps = _marks.get(request_id)
    if stamps is None:
        return
    stamps.append((phase, time.perf_counter()))
    if sum(1 for p, _ in stamps if p == "yield") >= YIELDS:
        del _marks[request_id]
        t0 = stamps[0][1]
        logger.info("handover [%s] %s=%.6f %s", request_id, stamps[0][0], t0, " ".join(
            f"{p}=+{1e3 * (t - t0):.3f}" for p, t in stamps[1:]))


def mark_all(phase: str) -> None:
    """Stamp `phase` for every request being stamped (the engine's step, phase by phase)."""
    if TRACE:
        for request_id in list(_marks):
            mark(request_id, phase)


def parse(line: str) -> tuple[str, list[tuple[str, float]]] | None:
    """A logged line's request id and its stamps [(phase, perf_counter seconds)], or None."""
    _, sep, rest = line.partition("handover [")
    if not sep:
        return None
    request_id, _, rest = rest.partition("] ")
    stamps, t0 = [], 0.0
    for item in rest.split():
        phase, _, value = item.partition("=")
        if value.startswith("+"):
            stamps.append((phase, t0 + float(value[1:]) / 1e3))
        else:
            t0 = float(value)
            stamps.append((phase, t0))
    return request_id, stamps


def in_batch_at(stamps: list[tuple[str, float]]) -> float | None:
    """When the committed request was first scheduled into a step: the first `scheduled`
    after `commit_run`."""
    committed = False
    for phase, t in stamps:
        committed = committed or phase == "commit_run"
        if committed and phase == "scheduled":
            return t
    return None


def traced() -> list[str]:
    """Requests being stamped now (the engine thread stamps its steps for them)."""
    return list(_marks) if TRACE else []


def merge(lines: list[str]) -> dict[str, list[tuple[str, float]]]:
    """Every request's stamps from log lines, those of several processes' lines for one
    request merged in time order."""
    stamps: dict[str, list[tuple[str, float]]] = {}
    for line in lines:
        parsed = parse(line)
        if parsed is not None:
            stamps.setdefault(parsed[0], []).extend(parsed[1])
    return {request_id: sorted(s, key=lambda stamp: stamp[1]) for request_id, s in stamps.items()}
