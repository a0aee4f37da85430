"""`python -m pdserve.bench.decode_streams` end to end on the CPU, small: a real decode worker,
three streams read over one GenerateStreams call and over a Generate call each, every token
delivered either way; the warm-up round is left out of the report; with the engine in a process
of its own, that process's CPU apart."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.bench import decode_streams


def test_both_modes_deliver_every_token_and_report_the_workers_cpu(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    decode_streams.add_arguments(parser)
    out = tmp_path / "streams.json"
    # enough tokens for the worker's CPU to span several of /proc's 10 ms ticks (15 tokens in
    # ~11 ms once read as 0)
    report = decode_streams.run(parser.parse_args([
        "--streams", "4", "--tokens", "32", "--rounds", "1", "--output-json", str(out)]))
    assert json.loads(out.read_text())["medians"] == report["medians"]
    for mode in ("shared", "per-request"):
        (row,) = report["rounds"][mode]
        assert row["tokens"] == 4 * 32 and row["tok_s"] > 0 and row["cpu_ms_per_1k_tokens"] > 0
        assert row["core_cpu_ms_per_1k_tokens"] == 0  # no engine core process
    assert report["cpu_ratio_shared_over_per_request"] > 0


def test_with_an_engine_core_process_its_cpu_is_reported_apart(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    decode_streams.add_arguments(parser)
    report = decode_streams.run(parser.parse_args([
        "--streams", "4", "--tokens", "128", "--rounds", "1", "--modes", "shared",
        "--engine-core", "process", "--output-json", str(tmp_path / "streams.json")]))
    (row,) = report["rounds"]["shared"]
    # enough tokens that the worker's share of a round spans several of /proc's 10 ms ticks
    assert row["tokens"] == 4 * 128
    assert row["cpu_ms_per_1k_tokens"] > 0 and row["core_cpu_ms_per_1k_tokens"] > 0


def test_an_unknown_mode_is_a_value_error_naming_the_flag(tmp_path: Path) -> None:
    import pytest

    parser = argparse.ArgumentParser()
    decode_streams.add_arguments(parser)
    with pytest.raises(ValueError, match="--modes"):
        decode_streams.run(parser.parse_args(["--modes", "shared,bidi",
                                              "--output-json", str(tmp_path / "x.json")]))
