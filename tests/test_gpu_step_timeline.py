"""pdserve/bench/gpu_step_timeline.py's summary of a GPU timeline (synthetic ops)."""

from __future__ import annotations

import pytest

from pdserve.bench.gpu_step_timeline import summarize


def test_summary_splits_each_token_into_busy_idle_and_named_ops():
    """Ten steps of 100 us: a 5 us input copy, a 60 us graph kernel and a 20 us argmax that
    overlaps nothing, then 15 us idle; the copy waits 5 us after the step's start."""
    ops = []
    for step in range(10):
        t = 100.0 * step
        ops += [(t + 5, t + 10, "Memcpy HtoD"), (t + 10, t + 70, "graph_kernel"),
                (t + 65, t + 85, "argmax")]  # overlaps the graph kernel by 5 us
    got = summarize(ops, tokens=11, skip=2)
    assert got["steps"] == 6 and got["wall_us"] == pytest.approx(100)
    assert got["busy_us"] == pytest.approx(80)  # 5 + 60 + the argmax's 15 past the kernel
    assert got["idle_us"] == pytest.approx(20)
    assert got["ops"]["graph_kernel"] == {"calls": 1, "us": 60}
    assert got["gaps"][0] == {"before": "argmax", "after": "Memcpy HtoD", "us": 20}


def test_summary_needs_enough_steps():
    with pytest.raises(ValueError, match="too few"):
        summarize([(0.0, 1.0, "k"), (2.0, 3.0, "k")], tokens=3)
