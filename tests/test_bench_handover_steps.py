"""pdserve.bench.handover_steps: a decode engine's step phases from the handover trace."""

from __future__ import annotations

from pdserve.bench import handover_steps

# two traced requests seeing the same two steps (10.000 and 10.004 s), then one more step
LOG = """\
[decode-0] 2026-12-05 17:05:21 INFO engine.handover_trace: handover [cmpl-a] commit_in=10.0 \
commit_run=+0.001 step=+0.000 scheduled=+0.500 launched=+2.000 landed=+2.300 sampling=+2.400 \
step=+4.000 scheduled=+4.400 launched=+6.000 landed=+6.500 sampling=+6.600 step=+8.600
[decode-0] 2026-12-05 17:05:21 INFO engine.handover_trace: handover [cmpl-b] commit_in=10.004 \
step=+0.000 scheduled=+0.400 launched=+2.000 landed=+2.500 sampling=+2.600 step=+4.600
[decode-0] 2026-12-05 17:05:21 INFO engine.handover_trace: handover [cmpl-c] commit_in=9.0 \
yield=+1.000 yield=+2.000
"""


def test_phases_of_each_step_and_their_windows(tmp_path) -> None:
    records = handover_steps.step_records(LOG)
    assert len(records) == 3  # a's two steps followed by another, b's one; c has no steps
    first = records[0]
    assert first[0] == 10.0
    assert [round(x, 3) for x in first[1]] == [0.5, 1.5, 0.3, 0.1, 1.6]
    rows = handover_steps.windows(records, window_ms=2.0)
    assert [r["t_ms"] for r in rows] == [0, 4]
    assert rows[0]["records"] == 1 and rows[0]["step"] == 4.0
    assert rows[1]["records"] == 2 and rows[1]["launch"] == 1.6  # (1.6 + 1.6) / 2
    log = tmp_path / "cluster.log"
    log.write_text(LOG)
    assert handover_steps.main([str(log)]) == 0
    assert handover_steps.main([str(log), "--window-ms", "0"]) == 2
    log.write_text("nothing traced\n")
    assert handover_steps.main([str(log)]) == 2
