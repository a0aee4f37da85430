"""`python -m pdserve.bench.prefill_burst` end to end on the CPU, small: real prefill and decode
workers over grpc, two bursts of three prompts; the warm-up burst is left out of the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.bench import prefill_burst


def test_a_burst_reports_its_wall_time_and_the_prefill_workers_cpu(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    prefill_burst.add_arguments(parser)
    out = tmp_path / "burst.json"
    report = prefill_burst.run(parser.parse_args([
        "--layers", "2", "--prompts", "3", "--rounds", "2", "--input-len", "16-40",
        "--transport", "grpc", "--output-json", str(out)]))
    assert json.loads(out.read_text())["rounds"] == report["rounds"]
    (only,) = report["rounds"]
    assert only["wall_s"] > 0 and only["cpu_s_per_prompt"] >= 0
    assert report["median_cpu_ms_per_prompt"] == 1e3 * only["cpu_s_per_prompt"]
