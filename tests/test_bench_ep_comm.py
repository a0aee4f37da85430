"""The EP communication benchmark's two paths give the same layer output (two gloo ranks)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import ep_comm


@pytest.mark.timeout(180)
def test_all_to_all_equals_replicated_on_two_ranks(tmp_path) -> None:
    out = tmp_path / "ep.json"
    # each size is checked inside the ranks (allclose, else the rank fails and run raises)
    ep_comm.main(["--device", "cpu", "--world", "2", "--tokens", "1,5,33", "--hidden", "16",
                  "--experts", "5", "--top-k", "2", "--iters", "1", "--warmup", "0",
                  "--output-json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 5, 33]
    assert all(r["replicated_us"] > 0 and r["all_to_all_us"] > 0 for r in rows)


def test_experts_are_dealt_whole_and_evenly() -> None:
    dealt = [ep_comm._experts_of(r, 3, 8).tolist() for r in range(3)]
    assert dealt == [[0, 1, 2], [3, 4, 5], [6, 7]]
