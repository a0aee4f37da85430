"""`python -m pdserve.bench.prefill_burst` end to end on the CPU, small: real prefill and decode
workers over grpc, two bursts of three prompts; the warm-up burst is left out of the report.
With `--engine-core process` the prefill engine runs in a process of its own
(prefill_svc/engine_core.py) and its CPU counts too."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench import prefill_burst


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_burst_reports_its_wall_time_and_the_prefill_workers_cpu(
        tmp_path: Path, engine_core: str) -> None:
    parser = argparse.ArgumentParser()
    prefill_burst.add_arguments(parser)
    out = tmp_path / "burst.json"
    report = prefill_burst.run(parser.parse_args([
        "--layers", "2", "--prompts", "3", "--rounds", "2", "--input-len", "16-40",
        "--transport", "grpc", "--engine-core", engine_core, "--output-json", str(out)]))
    assert json.loads(out.read_text())["rounds"] == report["rounds"]
    (only,) = report["rounds"]
    assert only["wall_s"] > 0 and only["second_s"] > 0 and only["cpu_s_per_prompt"] >= 0
    assert report["median_cpu_ms_per_prompt"] == 1e3 * only["cpu_s_per_prompt"]
