"""pdserve.bench.rss_calls: a call that grows the process is reported with its depth."""

from pdserve.bench.rss_calls import calls_growth, status_mib


def _touch(mib: int) -> bytearray:
    return bytearray(mib << 20)  # zero-filled: every page written, so resident


def _outer() -> bytearray:
    return _touch(16)


def test_calls_growth_names_the_call_that_grew_and_its_parent():
    held, calls = calls_growth(_outer, min_mib=8.0, depth=5)
    assert len(held) == 16 << 20
    names = [(c["call"].rsplit(":", 1)[1], c["depth"]) for c in calls]
    assert names == [("_touch", 1), ("_outer", 0)]
    assert all(c["mib"] >= 15 for c in calls)


def test_small_growth_and_deep_calls_are_left_out():
    _, calls = calls_growth(_outer, min_mib=64.0, depth=5)
    assert calls == []
    _, calls = calls_growth(_outer, min_mib=8.0, depth=0)
    assert [c["call"].rsplit(":", 1)[1] for c in calls] == ["_outer"]
    assert status_mib("VmRSS")["VmRSS"] > 0
