"""The gateway's order of a split request's calls (gateway/remote_backend.py): its Prefill goes
out beside the decode worker's reservation where that worker had the prompt's blocks free at its
last heartbeat and the prefill worker lists the feature, after it otherwise (the reservation may
queue for blocks; a prefill sent beside it would hold the prefill worker's blocks meanwhile; a
prefill worker of an earlier version would push before the blocks are reserved)."""

from __future__ import annotations

from gateway.remote_backend import _beside_possible, _room_for
from pdserve.cluster.registry import FEATURES, PREFILL_BESIDE_RESERVATION, WorkerInfo


def _decode(free: int, block_size: int = 16) -> WorkerInfo:
    return WorkerInfo("d0", "decode", "127.0.0.1:1", num_free_blocks=free,
                      num_total_blocks=64, block_size=block_size)


def test_beside_the_reservation_only_where_the_blocks_were_free() -> None:
    assert _room_for(_decode(free=3), 48)  # 3 blocks of 16
    assert _room_for(_decode(free=3), 33)
    assert not _room_for(_decode(free=3), 49)  # 4 blocks
    assert not _room_for(_decode(free=0), 1)
    assert not _room_for(_decode(free=64, block_size=0), 1)  # its entry does not say


def test_beside_the_reservation_only_with_a_prefill_worker_that_lists_it() -> None:
    new = WorkerInfo("p0", "prefill", "127.0.0.1:2", features=FEATURES["prefill"])
    old = WorkerInfo.from_json(new.to_json().replace(PREFILL_BESIDE_RESERVATION, "x"))
    earlier = WorkerInfo.from_json('{"worker_id": "p1", "role": "prefill", "address": "a:1"}')
    assert _beside_possible(new, _decode(free=3), 48)
    assert not _beside_possible(new, _decode(free=3), 49)
    assert not _beside_possible(old, _decode(free=3), 48)
    assert not _beside_possible(earlier, _decode(free=3), 48)  # an entry without features
