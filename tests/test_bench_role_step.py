"""pdserve.bench.role_step: times a decode step's CPU with requests admitted both ways."""

import json

from pdserve.bench import role_step


def test_reports_both_roles_each_round(tmp_path) -> None:
    out = tmp_path / "role.json"
    args = ["--requests", "3", "--steps", "2", "--rounds", "1", "--output-json", str(out)]
    assert role_step.main(args) == 0
    report = json.loads(out.read_text())
    assert set(report["rounds"][0]) == {"colocated", "decode"}
    assert all(v > 0 for v in report["medians"].values())


def test_bad_arguments_are_a_usage_error(tmp_path, capsys) -> None:
    assert role_step.main(["--steps", "0", "--output-json", str(tmp_path / "x.json")]) == 2
    assert "--steps" in capsys.readouterr().err
