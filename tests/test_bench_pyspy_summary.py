"""pdserve/bench/pyspy_summary.py on a hand-written py-spy raw file."""

from __future__ import annotations

import gzip

from pdserve.bench.pyspy_summary import summarise

RAW = """main (a.py:1);run (b.py:97);step (e.py:10);sample (s.py:5) 6
main (a.py:1);run (b.py:97);step (e.py:12);fill (g.py:3) 3
main (a.py:1);run (b.py:97) 1
main (a.py:1);run (b.py:95);step (e.py:10) 50
"""


def test_counts_only_below_the_frame_inclusive_and_self(tmp_path):
    path = tmp_path / "prof.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write(RAW)
    total, inclusive, own = summarise(str(path), "b.py:97)")
    assert total == 10
    assert inclusive["step (e.py)"] == 9 and inclusive["sample (s.py)"] == 6
    assert own == {"sample (s.py:5)": 6, "fill (g.py:3)": 3, "<the frame itself>": 1}
