"""A torch.profiler window over an engine's steps while it serves (vLLM's VLLM_TORCH_PROFILER_DIR).

    PDSERVE_TORCH_PROFILER_DIR=DIR [PDSERVE_TORCH_PROFILER_STEPS=skip,count]  (default 50,200)

Every engine process started with the variable set (a worker of `pdserve up`, `pdserve serve`)
profiles its steps skip .. skip + count - 1, or from step skip until the engine first runs out
of work (CPU and CUDA activity of the whole process: the KV pushes and copies of other threads
too), and writes DIR/<role>-<pid>.summary.json:

    window_s        wall time of the window (first profiled step's start to the last's end)
    steps           steps profiled; step_ms p50 / p90 / max: each step's wall time
    gpu_busy_s      the union of the window's kernel and memcpy intervals on the GPU
    kernel_s        their summed durations (above gpu_busy_s: they overlapped)
    top             the 15 kernels with the most total time: name, calls, total and mean ms

A kernel's interval runs from its start to its end on the GPU, so time the GPU spends on
another process's context in between (two processes time-slice one GPU) counts in it: a decode
worker's kernels that take longer beside a prefill worker than alone show that. The chrome trace
is kept beside the summary (DIR/<role>-<pid>.trace.json) for a timeline view.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_DIR, ENV_STEPS = "PDSERVE_TORCH_PROFILER_DIR", "PDSERVE_TORCH_PROFILER_STEPS"


class StepProfiler:
    def __init__(self, out_dir: str, role: str, skip: int = 50, count: int = 200) -> None:
        if skip < 0 or count < 1:
            raise ValueError(f"{ENV_STEPS}: skip >= 0 and count >= 1, got {skip},{count}")
        self.out_dir, self.role, self.skip, self.count = Path(out_dir), role, skip, count
        self._seen, self._prof, self._step_s, self._start = 0, None, [], 0.0

    @classmethod
    def from_env(cls, role: str) -> StepProfiler | None:
        out_dir = os.environ.get(ENV_DIR)
        if not out_dir:
            return None
        steps = os.environ.get(ENV_STEPS, "50,200")
        try:
            skip, count = (int(v) for v in steps.split(","))
        except ValueError:
            raise ValueError(f"{ENV_STEPS}={steps!r}: expected skip,count") from None
        return cls(out_dir, role, skip, count)

    def step(self, fn: Callable[[], Any]) -> Any:
        """Run one engine step, inside the window if it is one of its steps."""
        index, self._seen = self._seen, self._seen + 1
        if not self.skip <= index < self.skip + self.count:
            return fn()
        if self._prof is None:
            import torch
            from torch.profiler import ProfilerActivity, profile

            gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self._prof = profile(activities=[ProfilerActivity.CPU, *gpu])
            self._prof.__enter__()
            self._start = time.perf_counter()
        begin = time.perf_counter()
        out = fn()
        self._step_s.append(time.perf_counter() - begin)
        if index == self.skip + self.count - 1:
            self._finish()
        return out

    def idle(self) -> None:
        """The engine has no work: a window that began ends here."""
        if self._prof is not None:
            self._finish()
            self.count = 0  # nothing more

    def _finish(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        window = time.perf_counter() - self._start
        self._prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"{self.role}-{os.getpid()}"
        trace = stem.with_suffix(".trace.json")
        self._prof.export_chrome_trace(str(trace))
        summary = {"role": self.role, "window_s": window, **summarize(trace, self._step_s)}
        stem.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        logger.info("profiled %d steps: %s", len(self._step_s), stem)
        self._prof = None


def covered(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, stop) intervals (the GPU's busy time of kernels
    that may overlap)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def summarize(trace: Path, step_s: list[float]) -> dict[str, Any]:
    """The summary's GPU and step figures from a chrome trace (see the module docstring)."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and "dur" in e]
    busy = covered((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_name.setdefault(e["name"], []).append(float(e["dur"]))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    ms = sorted(s * 1e3 for s in step_s)
    return {
        "steps": len(ms),
        "step_ms": {"p50": statistics.median(ms), "p90": ms[int(0.9 * (len(ms) - 1))],
                    "max": ms[-1]} if ms else {},
        "gpu_busy_s": busy / 1e6,
        "kernel_s": sum(e["dur"] for e in gpu) / 1e6,
        "kernels": len(gpu),
        "top": [{"name": name[:120], "calls": len(d), "total_ms": sum(d) / 1e3,
                 "mean_us": sum(d) / len(d)} for name, d in top],
    }
