"""PDSERVE_STEP_TIMELINE=DIR: an engine process's steps and garbage collections in time order.

The stack sampler (engine/stack_sampler.py) and the step profiler (engine/step_profiler.py)
add up where time went; a burst's stall of tens of milliseconds disappears in their sums. Here
every engine step is kept as (start, seconds, outputs, device wait, CPU) and every collection
as (start, seconds, generation), on `time.perf_counter()` (CLOCK_MONOTONIC: one clock for
every process of a host), and written to DIR/<role>-<pid>.timeline.json every few seconds and
at exit:

    {"role": ..., "pid": ..., "steps": [[t, s, n, wait, cpu], ...],
     "gc": [[t, s, generation], ...]}

`wait`: the seconds the step blocked on the device for sampled tokens (engine/device_wait.py);
`cpu`: the loop thread's CPU seconds in the step (`time.thread_time()`: waits that spin count
in it too). A step's wall time less its wait is the host's; where that grows at the same batch
while its CPU grows with it, the host ran slower, not the GPU. A step costs four clock reads,
two reads of the wait's total and a list append; a collection two clock reads. At most
MAX_ENTRIES of each are kept (the first ones).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

from engine.device_wait import waited_s

ENV_DIR = "PDSERVE_STEP_TIMELINE"
MAX_ENTRIES = 200_000
DUMP_EVERY_S = 5.0
_timelines: list[StepTimeline] = []  # this process's, newest last


class StepTimeline:
    def __init__(self, out_dir: str, role: str) -> None:
        self.path = Path(out_dir) / f"{role}-{os.getpid()}.timeline.json"
        self.role = role
        self.steps: list[tuple[float, float, int, float, float]] = []
        self.collections: list[tuple[float, float, int]] = []
        self._gc_start = 0.0
        self._dumped_at = time.perf_counter()
        gc.callbacks.append(self._on_gc)
        atexit.register(self.dump)
        _timelines.append(self)

    @classmethod
    def from_env(cls, role: str) -> StepTimeline | None:
        out_dir = os.environ.get(ENV_DIR)
        return cls(out_dir, role) if out_dir else None

    def step(self, fn: Any) -> Any:
        """Run one engine step (`fn()`, returning its outputs) and note it."""
        waited, cpu = waited_s(), time.thread_time()
        start = time.perf_counter()
        outputs = fn()
        end = time.perf_counter()
        if len(self.steps) < MAX_ENTRIES:
            self.steps.append((start, end - start, len(outputs), waited_s() - waited,
                               time.thread_time() - cpu))
        if end - self._dumped_at > DUMP_EVERY_S:
            self.dump()
        return outputs

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
        elif len(self.collections) < MAX_ENTRIES:
            self.collections.append((self._gc_start, now - self._gc_start,
                                     info.get("generation", -1)))

    def dump(self) -> None:
        self._dumped_at = time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"role": self.role, "pid": os.getpid(),
                                   "steps": [[round(t, 6), round(s, 6), n, round(w, 6),
                                              round(c, 6)] for t, s, n, w, c in self.steps],
                                   "gc": [[round(t, 6), round(s, 6), g]
                                          for t, s, g in self.collections]}))
        tmp.replace(self.path)

    def close(self) -> None:
        """Stop noting collections and write what was noted."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self in _timelines:
            _timelines.remove(self)
        self.dump()


def watch_collections(role: str) -> StepTimeline | None:
    """A process without an engine step loop (a server whose engine runs in another process,
    a gateway): its collections noted, as a timeline without steps, when PDSERVE_STEP_TIMELINE
    is set and no timeline of this process notes them already."""
    if _timelines:
        return None
    return StepTimeline.from_env(role)
