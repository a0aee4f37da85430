"""`python -m pdserve.bench.gc_pause`: a role's imports, its full collections timed before and
after the heap is frozen, the freeze undone afterwards."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from pdserve.bench import gc_pause


def test_the_report_counts_the_heap_and_leaves_nothing_frozen(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    assert gc_pause.main(["--role", "gateway", "--repeats", "2", "--output-json",
                          str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["frozen"] >= report["tracked_objects"] * 0.9 > 0
    assert len(report["full_collection_ms"]) == len(report["full_collection_ms_frozen"]) == 2
    assert gc.get_freeze_count() == 0
