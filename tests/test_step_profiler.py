"""engine/step_profiler.py: the window over an engine's steps, its summary, the env settings."""

from __future__ import annotations

import json

import pytest
import torch

from engine.step_profiler import StepProfiler, summarize


def test_profiles_exactly_the_window_and_writes_its_summary(tmp_path):
    prof, calls = StepProfiler(str(tmp_path), "decode", skip=2, count=3), []

    def step():
        calls.append(len(calls))
        return torch.ones(64, 64) @ torch.ones(64, 64)

    for _ in range(8):
        assert prof.step(step).shape == (64, 64)
    assert calls == list(range(8))
    (summary_file,) = tmp_path.glob("decode-*.summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["role"] == "decode" and summary["steps"] == 3
    assert summary["window_s"] > 0 and summary["step_ms"]["max"] >= summary["step_ms"]["p50"]
    assert summary["gpu_busy_s"] == 0.0 and summary["kernels"] == 0  # on the CPU: no GPU work
    assert list(tmp_path.glob("decode-*.trace.json"))


def test_gpu_busy_is_the_union_of_overlapping_intervals(tmp_path):
    trace = tmp_path / "t.json"
    events = [{"cat": "kernel", "name": "a", "ts": 0, "dur": 10},
              {"cat": "kernel", "name": "b", "ts": 5, "dur": 10},  # overlaps a: 0..15
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 20, "dur": 5},
              {"cat": "kernel", "name": "a", "ts": 21, "dur": 2},  # inside the copy
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]  # not the GPU's
    trace.write_text(json.dumps({"traceEvents": events}))
    s = summarize(trace, [0.001, 0.003, 0.002])
    assert s["gpu_busy_s"] == pytest.approx(20e-6) and s["kernel_s"] == pytest.approx(27e-6)
    assert s["kernels"] == 4 and s["step_ms"]["p50"] == pytest.approx(2.0)
    assert s["top"][0] == {"name": "a", "calls": 2, "total_ms": 0.012, "mean_us": 6.0}


def test_env_settings(monkeypatch):
    monkeypatch.delenv("PDSERVE_TORCH_PROFILER_DIR", raising=False)
    assert StepProfiler.from_env("prefill") is None
    monkeypatch.setenv("PDSERVE_TORCH_PROFILER_DIR", "/tmp/p")
    monkeypatch.setenv("PDSERVE_TORCH_PROFILER_STEPS", "10,20")
    prof = StepProfiler.from_env("prefill")
    assert (prof.skip, prof.count, prof.role) == (10, 20, "prefill")
    for bad in ("10", "a,b", "-1,5", "3,0"):
        monkeypatch.setenv("PDSERVE_TORCH_PROFILER_STEPS", bad)
        with pytest.raises(ValueError, match="PDSERVE_TORCH_PROFILER_STEPS"):
            StepProfiler.from_env("prefill")


def test_a_window_ends_when_the_engine_runs_out_of_work(tmp_path):
    prof = StepProfiler(str(tmp_path), "prefill", skip=1, count=100)
    prof.idle()  # before the window: nothing
    for _ in range(4):
        prof.step(lambda: torch.zeros(4).sum())
    prof.idle()
    prof.step(lambda: None)  # after it: not profiled again
    (summary_file,) = tmp_path.glob("prefill-*.summary.json")
    assert json.loads(summary_file.read_text())["steps"] == 3
