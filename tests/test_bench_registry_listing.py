"""`python -m pdserve.bench.registry_listing` on a throw-away redis-server, small: both listings
find the 4 registered workers among other keys, and the report holds a row per count."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench import registry_listing


def test_both_listings_are_timed_at_each_count(tmp_path: Path) -> None:
    out = tmp_path / "listing.json"
    assert registry_listing.main(["--keys", "300,0", "--repeats", "2",
                                  "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["other_keys"] for r in rows] == [0, 300]
    assert all(r["index_ms"] > 0 and r["scan_ms"] > 0 for r in rows)
