"""pdserve.bench.stream_log: streams recorded through the gateway's recorder and log writer
against streams only numbered, on a real Redis."""

from __future__ import annotations

import shutil

import pytest

from pdserve.bench import stream_log


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_both_modes_measured(tmp_path) -> None:
    out = tmp_path / "r.json"
    report = stream_log.run(stream_log_args(out))
    assert set(report["medians"]) == {"recorded", "unrecorded"}
    for rounds in report["rounds"].values():
        assert len(rounds) == 1 and all(x > 0 for x in rounds[0])
    assert out.is_file() and "recording_cpu_us_per_event" in report
    assert stream_log.main(["--streams", "0"]) == 2


def stream_log_args(out):
    import argparse

    parser = argparse.ArgumentParser()
    stream_log.add_arguments(parser)
    return parser.parse_args(["--streams", "3", "--steps", "4", "--step-ms", "1", "--rounds", "1",
                              "--output-json", str(out)])
