"""The examples run as a user would run them: examples/data_parallel.py with two DP ranks on the
CPU gives every prompt an output, each from the rank whose contiguous share holds it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_data_parallel_example_splits_the_prompts_over_the_ranks() -> None:
    argv = [sys.executable, "examples/data_parallel.py", "--dp-size", "2", "--tp-size", "1",
            "--num-prompts", "3", "--max-tokens", "4", "--device", "cpu"]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    # not anchored at a line's start: the ranks share one stdout, and a line of one can land
    # after another process's unfinished line (once on a loaded 2-core box rank 1's went unmatched)
    ranks = {int(m["prompt"]): int(m["rank"]) for m in re.finditer(
        r"DP rank (?P<rank>\d+), prompt (?P<prompt>\d+): ", run.stdout)}
    assert ranks == {0: 0, 1: 0, 2: 1}, run.stdout  # 3 prompts over 2 ranks: [0 1] [2]
    assert "3 outputs from 2 DP ranks x TP 1" in run.stdout


def test_data_parallel_shares_are_contiguous_and_gpus_disjoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("data_parallel",
                                                  ROOT / "examples" / "data_parallel.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert [list(example.share(10, 4, r)) for r in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [list(example.share(1, 3, r)) for r in range(3)] == [[0], [], []]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [example.gpus_of(r, 2) for r in range(2)] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # ranks pick among the shell's GPUs
    assert [example.gpus_of(r, 2) for r in range(2)] == ["4,5", "6,7"]
