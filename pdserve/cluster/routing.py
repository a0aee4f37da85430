"""Routing policy: which registered worker gets the next request. Pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.cluster.registry import WorkerInfo


def pick_decode(workers: Iterable[WorkerInfo]) -> WorkerInfo | None:
    """The decode worker with the most free KV blocks; ties go to fewer running requests, then
    to the smaller worker_id. Workers of other roles are ignored; None if there is none."""
    decode = [w for w in workers if w.role == "decode"]
    return min(decode, key=lambda w: (-w.num_free_blocks, w.num_running, w.worker_id),
               default=None)


def pick_prefill(workers: Iterable[WorkerInfo]) -> WorkerInfo | None:
    """The prefill worker with the shortest queue (num_waiting + num_running); ties go to more
    free KV blocks, then to the smaller worker_id. Workers of other roles are ignored; None if
    there is none."""
    prefill = [w for w in workers if w.role == "prefill"]
    return min(prefill,
               key=lambda w: (w.num_waiting + w.num_running, -w.num_free_blocks, w.worker_id),
               default=None)
