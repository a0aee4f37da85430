"""pdserve.bench.pack_step: packs its three steps and reports each one's times."""

import json

import pytest

from pdserve.bench import pack_step


def test_reports_each_step(tmp_path) -> None:
    out = tmp_path / "pack.json"
    assert pack_step.main(["--repeats", "2", "--output-json", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    assert set(steps) == {"prefill 9 x 1024", "prefill 1 x 8192", "decode 256 x 400"}
    for times in steps.values():
        assert 0 < times["best_ms"] <= times["median_ms"]


def test_bad_arguments_are_a_usage_error(tmp_path, capsys) -> None:
    assert pack_step.main(["--repeats", "0", "--output-json", str(tmp_path / "x.json")]) == 2
    assert "--repeats" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pack_step.main(["--repeats", "many"])
