"""pdserve.bench.cpu_decode_ops on the bundled model: it counts the ops and names their lines."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import cpu_decode_ops

pytestmark = pytest.mark.slow


def test_ops_are_counted_per_token_by_engine_line(tmp_path) -> None:
    out = tmp_path / "ops.json"
    assert cpu_decode_ops.main(["--tokens", "2", "--top", "5", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ops_per_token"] > 100  # 30 layers of several ops each
    assert len(report["sites"]) == 5
    assert all(site.startswith(("engine/", "kernels/")) for site in report["sites"])
    assert report["ms_per_token"] > 0 and report["self_ms"]
