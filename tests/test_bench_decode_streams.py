"""`python -m pdserve.bench.decode_streams` end to end on the CPU, small: a real decode worker,
three streams read over one GenerateStreams call and over a Generate call each, every token
delivered either way; the warm-up round is left out of the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.bench import decode_streams


def test_both_modes_deliver_every_token_and_report_the_workers_cpu(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    decode_streams.add_arguments(parser)
    out = tmp_path / "streams.json"
    report = decode_streams.run(parser.parse_args([
        "--streams", "3", "--tokens", "5", "--rounds", "1", "--output-json", str(out)]))
    assert json.loads(out.read_text())["medians"] == report["medians"]
    for mode in ("shared", "per-request"):
        (row,) = report["rounds"][mode]
        assert row["tokens"] == 3 * 5 and row["tok_s"] > 0 and row["cpu_ms_per_1k_tokens"] > 0
    assert report["cpu_ratio_shared_over_per_request"] > 0


def test_an_unknown_mode_is_a_value_error_naming_the_flag(tmp_path: Path) -> None:
    import pytest

    parser = argparse.ArgumentParser()
    decode_streams.add_arguments(parser)
    with pytest.raises(ValueError, match="--modes"):
        decode_streams.run(parser.parse_args(["--modes", "shared,bidi",
                                              "--output-json", str(tmp_path / "x.json")]))
