"""pdserve.bench.schedule_step: schedules and updates its decodes, makes their outputs, and
reports each per request."""

import json

import pytest

from pdserve.bench import schedule_step


def test_reports_each_round_and_the_medians(tmp_path) -> None:
    out = tmp_path / "schedule.json"
    args = ["--requests", "8", "--steps", "5", "--rounds", "2", "--output-json", str(out)]
    assert schedule_step.main(args) == 0
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2
    for key in ("schedule_us_per_request", "update_us_per_request", "outputs_us_per_request"):
        assert report["medians"][key] > 0


def test_bad_arguments_are_a_usage_error(tmp_path, capsys) -> None:
    assert schedule_step.main(["--steps", "0", "--output-json", str(tmp_path / "x.json")]) == 2
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        schedule_step.main(["--requests", "many"])
