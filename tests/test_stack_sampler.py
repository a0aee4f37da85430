"""engine/stack_sampler.py: a process samples its own threads' stacks into py-spy's raw format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine.stack_sampler import start_from_env
from pdserve.bench import stack_samples
from pdserve.bench.pyspy_summary import summarise


def test_a_busy_thread_is_sampled_where_it_spins_and_its_cpu_counted(tmp_path) -> None:
    script = textwrap.dedent("""
        import threading, time
        from engine.stack_sampler import start_from_env

        def spin_here():
            end = time.monotonic() + 1.2
            while time.monotonic() < end:
                pass

        start_from_env("probe")
        worker = threading.Thread(target=spin_here, name="spinner")
        worker.start()
        worker.join()
        time.sleep(0.2)
    """)
    env = {"PDSERVE_STACK_SAMPLES": str(tmp_path), "PDSERVE_STACK_SAMPLE_HZ": "200"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   env={**os.environ, **env})
    (stacks,) = tmp_path.glob("probe-*.txt")
    total, inclusive, _ = summarise(str(stacks), "spin_here")
    assert total >= 40  # 1.2 s at 200 Hz; a spinning thread hands over the GIL every 5 ms
    assert all(line.startswith(("spinner;", "MainThread;"))
               for line in stacks.read_text().splitlines())
    cpu = json.loads(stacks.with_suffix(".cpu.json").read_text())
    assert cpu["samples"] >= 60
    spinner = [s for name, s in cpu["threads_cpu_s"].items() if name.startswith("spinner ")]
    assert spinner and spinner[0] >= 0.6  # ended before the last dump: kept from a reading
    summary = stack_samples.summarise(tmp_path)[stacks.stem]
    spin = summary["threads"]["spinner"]
    assert spin["busy_samples"] >= 40 and "spin_here" in spin["lines"][0][0]
    assert "MainThread" not in summary["threads"]  # asleep: under --min-cpu


def test_nothing_starts_without_the_variable_and_a_bad_rate_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_STACK_SAMPLES", raising=False)
    assert start_from_env("x") is None
    monkeypatch.setenv("PDSERVE_STACK_SAMPLES", str(tmp_path))
    monkeypatch.setenv("PDSERVE_STACK_SAMPLE_HZ", "0")
    with pytest.raises(ValueError, match="PDSERVE_STACK_SAMPLE_HZ"):
        start_from_env("x")
