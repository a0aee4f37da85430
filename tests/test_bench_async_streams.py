"""`python -m pdserve.bench.async_streams`, small: every stream gets exactly its tokens (the
bench asserts it) and the report holds the rounds after the warm-up."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench import async_streams


def test_rounds_after_the_warm_up_are_reported(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    assert async_streams.main(["--streams", "6", "--tokens", "5", "--rounds", "2",
                               "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    (only,) = report["rounds"]
    assert only["tok_s"] > 0 and only["cpu_ms_per_1k_tokens"] > 0
    assert report["median_tok_s"] == only["tok_s"]
