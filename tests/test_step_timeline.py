"""engine/step_timeline.py notes steps and collections in time order; pdserve.bench.step_gaps
finds the longest steps, the widest gaps and the collections."""

from __future__ import annotations

import gc
import json
import time

from engine.step_timeline import StepTimeline
from pdserve.bench import step_gaps


def test_steps_and_collections_are_noted_and_written(tmp_path) -> None:
    timeline = StepTimeline(str(tmp_path), "decode")
    try:
        assert timeline.step(lambda: [1, 2, 3]) == [1, 2, 3]
        time.sleep(0.03)  # a gap
        timeline.step(lambda: time.sleep(0.02) or [])  # a long step
        gc.collect()
    finally:
        timeline.close()
    data = json.loads(timeline.path.read_text())
    assert data["role"] == "decode" and [n for _, _, n in data["steps"]] == [3, 0]
    assert data["steps"][1][1] >= 0.02
    assert any(g == 2 for _, _, g in data["gc"])
    summary = step_gaps.report(tmp_path, top=1, min_gc_ms=0.0)[0]
    assert summary["steps"] == 2 and summary["longest_steps"][0]["ms"] >= 20
    assert summary["widest_gaps"][0]["ms"] >= 30
    assert summary["collections"]


def test_no_timeline_is_an_error(tmp_path) -> None:
    assert step_gaps.main([str(tmp_path)]) == 2
