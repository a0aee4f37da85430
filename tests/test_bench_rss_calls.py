"""pdserve.bench.rss_calls: a call that grows the process is reported with its depth."""

import mmap
import os

from pdserve.bench import rss_calls
from pdserve.bench.rss_calls import status_mib

HERE = os.path.dirname(os.path.abspath(__file__))


def calls_growth(build, min_mib, depth):
    return rss_calls.calls_growth(build, min_mib, depth, root=HERE)


def _touch(mib: int) -> mmap.mmap:
    """`mib` MiB of fresh pages, each written (so resident). A fresh mapping, not the heap:
    after earlier tests glibc may serve even 16 MiB from freed heap already resident."""
    pages = mmap.mmap(-1, mib << 20)
    for offset in range(0, mib << 20, mmap.PAGESIZE):
        pages[offset] = 1
    return pages


def _outer() -> mmap.mmap:
    return _touch(16)


def test_calls_growth_names_the_call_that_grew_and_its_parent():
    held, calls = calls_growth(_outer, min_mib=8.0, depth=5)
    assert len(held) == 16 << 20
    held.close()
    names = [(c["call"].rsplit(":", 1)[1], c["depth"]) for c in calls]
    assert names == [("_touch", 1), ("_outer", 0)]
    assert all(c["mib"] >= 15 for c in calls)


def test_small_growth_and_deep_calls_are_left_out():
    _, calls = calls_growth(_outer, min_mib=64.0, depth=5)
    assert calls == []
    _, calls = calls_growth(_outer, min_mib=8.0, depth=0)
    assert [c["call"].rsplit(":", 1)[1] for c in calls] == ["_outer"]
    assert status_mib("VmRSS")["VmRSS"] > 0
