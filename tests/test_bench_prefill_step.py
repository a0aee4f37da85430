"""pdserve/bench/prefill_step.py: its flags and its profiler probe (the model run is the
device's: `python -m pdserve.bench.prefill_step`)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.prefill_step import lengths_of, profiled, row_keys_of


def test_lengths_are_a_comma_list_in_range() -> None:
    assert lengths_of("128, 512,8192") == [128, 512, 8192]
    for bad in ("", "0", "12,x", "40000"):
        with pytest.raises(ValueError, match="--lengths"):
            lengths_of(bad)


def test_row_keys_are_a_comma_list_of_caps() -> None:
    assert row_keys_of("0, 262144") == [0, 262144]
    for bad in ("", "-1", "x"):
        with pytest.raises(ValueError, match="--row-keys"):
            row_keys_of(bad)


def test_the_probe_counts_the_torch_ops_of_a_call() -> None:
    a = torch.ones(8, 8)
    probe = profiled(lambda: (a @ a).relu().sum())
    assert probe["cpu_ops"] >= 3  # mm, relu, sum at least
    names = [t["name"] for t in probe["top_self_cpu"]]
    assert any("mm" in n for n in names)
    if not torch.cuda.is_available():
        assert probe["gpu_busy_ms"] is None and probe["kernels"] is None
