"""Routing policy: which registered worker gets the next request. Pure functions, no I/O.

NOTE (kv_aware, prefill workers): each candidate w scores

    score(w) = hit(w) - load(w)
    hit(w)   = leading prompt blocks w's prefix cache holds / full prompt blocks     in [0, 1]
    load(w)  = q / (q + QUEUE_HALF), q = waiting + running requests on w            in [0, 1)

and the highest score wins (ties: shorter queue, more free KV blocks, smaller worker_id). The
load term is half its weight at QUEUE_HALF queued requests: a turn whose history one worker
holds goes there while that worker is busy, but a small shared prefix does not pull requests
onto a saturated worker (hit 0.1 against a queue of 8: 0.1 - 0.67 < 0 for an idle peer). With no
hits anywhere it is the `load` policy.

NOTE (kv_aware, decode workers): a decode worker holding a prefix is pushed only the blocks
after it (decode-side reuse), which saves transfer and cache space but no compute, so a hit
weighs less and the load is the KV cache's fill:

    score(w) = DECODE_HIT_WEIGHT * hit(w) - used(w),   used(w) = 1 - free blocks / total

(a full hit is worth half the cache: it never sends a request to a worker 60% fuller than an
empty peer). With no hits anywhere it is the `load` policy: most free KV blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdserve.cluster.registry import WorkerInfo

ROUTING = ("kv_aware", "load", "round_robin")
QUEUE_HALF = 4
DECODE_HIT_WEIGHT = 0.5


def pick_decode(
    workers: Iterable[WorkerInfo], hit_blocks: Mapping[str, int] | None = None,
    prompt_blocks: int = 0,
) -> WorkerInfo | None:
    """The decode worker by the NOTE's score; without hits, the one with the most free KV
    blocks. Ties go to more free blocks, fewer running requests, then the smaller worker_id.
    Workers of other roles are ignored; None if there is none."""
    decode = [w for w in workers if w.role == "decode"]
    hits = hit_blocks if prompt_blocks and any((hit_blocks or {}).values()) else {}

    def key(w: WorkerInfo) -> tuple:
        score = 0.0
        if hits:
            used = 1.0 - w.num_free_blocks / w.num_total_blocks if w.num_total_blocks else 1.0
            score = DECODE_HIT_WEIGHT * hits.get(w.worker_id, 0) / prompt_blocks - used
        return (-score, -w.num_free_blocks, w.num_running, w.worker_id)

    return min(decode, key=key, default=None)


def pick_prefill(
    workers: Iterable[WorkerInfo], hit_blocks: Mapping[str, int] | None = None,
    prompt_blocks: int = 0,
) -> WorkerInfo | None:
    """The prefill worker by the NOTE's score (`hit_blocks`: worker_id -> leading prompt blocks
    it holds, of `prompt_blocks`); without hits, the shortest queue (num_waiting +
    num_running), ties to more free KV blocks, then the smaller worker_id. Workers of other
    roles are ignored; None if there is none."""
    prefill = [w for w in workers if w.role == "prefill"]
    if not prefill:
        return None

    def key(w: WorkerInfo) -> tuple:
        queue = w.num_waiting + w.num_running
        hit = (hit_blocks or {}).get(w.worker_id, 0) / prompt_blocks if prompt_blocks else 0.0
        return (-(hit - queue / (queue + QUEUE_HALF)), queue, -w.num_free_blocks, w.worker_id)

    return min(prefill, key=key)


def pick_round_robin(workers: Iterable[WorkerInfo], role: str, turn: int) -> WorkerInfo | None:
    """The `turn`-th worker of `role` (by worker_id, cyclically); None if there is none."""
    of_role = sorted((w for w in workers if w.role == role), key=lambda w: w.worker_id)
    return of_role[turn % len(of_role)] if of_role else None
