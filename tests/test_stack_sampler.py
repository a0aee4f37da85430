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


def test_a_gated_sampler_counts_only_while_its_path_exists(tmp_path) -> None:
    gate = tmp_path / "load-running"
    script = textwrap.dedent(f"""
        import pathlib, time
        from engine.stack_sampler import start_from_env

        def spin(seconds):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass

        def before_the_gate():
            spin(0.6)

        def inside_the_gate():
            spin(0.8)

        start_from_env("gated")
        before_the_gate()
        pathlib.Path({str(gate)!r}).touch()
        inside_the_gate()
    """)
    env = {"PDSERVE_STACK_SAMPLES": str(tmp_path / "stacks"), "PDSERVE_STACK_SAMPLE_HZ": "200",
           "PDSERVE_STACK_SAMPLE_WHILE": str(gate)}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   env={**os.environ, **env})
    (stacks,) = (tmp_path / "stacks").glob("gated-*.txt")
    assert summarise(str(stacks), "inside_the_gate")[0] >= 20
    assert summarise(str(stacks), "before_the_gate")[0] == 0
    cpu = json.loads(stacks.with_suffix(".cpu.json").read_text())["threads_cpu_s"]
    main = next(s for name, s in cpu.items() if name.startswith("MainThread "))
    assert 0.4 <= main <= 1.2  # the gated spin, not the first one (nor the imports)
