"""PDSERVE_HANDOVER_TRACE=1: stamp a decode worker's committed requests on their way from the
KV commit into the decode batch and out as tokens, and log the stamps once the request's second
token leaves. For finding where a handover's milliseconds go; off (one bool test) otherwise.

Stamps are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for every process of a
host), so a log line lines up with the prefill worker's or a benchmark's stamps. The log line:

    handover [request] commit_in=T0 commit_run=+ms step=+ms ... yield=+ms ...

`commit_in` the PushKV commit read by the receiver, `commit_run` the engine thread committing it,
`step` each engine step begun while the request waits for its tokens (`step_out` when one
returned outputs for it), `yield` each Generate message with its tokens handed to gRPC.
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


def traced() -> list[str]:
    """Requests being stamped now (the engine thread stamps its steps for them)."""
    return list(_marks) if TRACE else []
