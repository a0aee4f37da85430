"""Routing policy: which registered worker gets the next request. Pure functions, no I/O.

NOTE (kv_aware, prefill workers): each candidate w scores

    score(w) = hit(w) - load(w)
    hit(w)   = leading prompt blocks w's prefix cache holds / full prompt blocks     in [0, 1]
    load(w)  = q / (q + QUEUE_HALF)                                                  in [0, 1)
    q        = max(waiting + running requests on w in the registry,
                   requests this gateway routed to w still before their first token)

and the highest score wins (ties: shorter queue, more free KV blocks, then at random; see
below). The
load term is half its weight at QUEUE_HALF queued requests: a turn whose history one worker
holds goes there while that worker is busy, but a small shared prefix does not pull requests
onto a saturated worker (hit 0.1 against a queue of 8: 0.1 - 0.67 < 0 for an idle peer). With no
hits anywhere it is the `load` policy. The registry's counts are up to a heartbeat old (a third
of the TTL); the gateway's own requests count from the routing decision on (gateway/
worker_pool.py `claim`), so requests arriving between two heartbeats, or while the one before
them waits for its decode worker's reservation, do not all herd onto the worker that looked
idle (several gateways: each counts its own, the registry all of them).

NOTE (kv_aware, decode workers): a decode worker holding a prefix is pushed only the blocks
after it (decode-side reuse), which saves transfer and cache space but no compute, so a hit
weighs less and the load is the KV cache's fill:

    score(w) = DECODE_HIT_WEIGHT * hit(w) - used(w),   used(w) = 1 - free blocks / total

(a full hit is worth half the cache: it never sends a request to a worker 60% fuller than an
empty peer). With no hits anywhere it is the `load` policy: most free KV blocks.

NOTE (ties): what is left equal after the score and the load counts is decided at random (the
caller's `rng`; without one, the smaller worker_id). Idle workers tie on everything, and a fixed
tie-break would send every request of a light load to one worker: under `load` that is an
accidental prefix affinity (a conversation's turns all land where its history is cached, so
load routing looks kv-aware), and under kv_aware it piles new conversations, which hit nowhere
beyond a shared system prompt, onto one worker's cache. A rotation is no better: with requests
of N conversations interleaved in turn it lands every turn of a conversation on the same worker
(N a multiple of the workers) or never twice on one (N odd, two workers).

NOTE (LoRA, kv_aware and load): a request under a LoRA adapter prefers workers whose registry
entry lists the adapter (WorkerInfo.lora_adapters): the others would first read it from disk
(and may evict another adapter for it). Each score above gains

    prefill:  + PREFILL_LORA_WEIGHT * held(w)     held(w) = 1 if w holds the adapter, else 0
    decode:   + DECODE_LORA_WEIGHT  * held(w)

PREFILL_LORA_WEIGHT = 0.5 is what a queue of QUEUE_HALF requests costs (an idle worker without
the adapter wins over one holding it with 5 queued: 0.5 - 5/9 < 0); DECODE_LORA_WEIGHT = 0.25 is
a quarter of the cache. Prefix hits are per adapter already (a block's hash chain starts from
the adapter's name, engine/block_manager.py), so a hit implies the adapter was there. A request
of the base model scores as before.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from pdserve.cluster.registry import WorkerInfo

ROUTING = ("kv_aware", "load", "round_robin")
QUEUE_HALF = 4
DECODE_HIT_WEIGHT = 0.5
PREFILL_LORA_WEIGHT = 0.5
DECODE_LORA_WEIGHT = 0.25


def pick_decode(
    workers: Iterable[WorkerInfo], hit_blocks: Mapping[str, int] | None = None,
    prompt_blocks: int = 0, lora: str | None = None, rng: random.Random | None = None,
) -> WorkerInfo | None:
    """The decode worker by the NOTE's score (`lora`: the request's adapter); without hits or
    adapter, the one with the most free KV blocks. Ties go to more free blocks, fewer running
    requests, then at random (`rng`; without it, the smaller worker_id). Workers of other roles
    are ignored; None if there is none."""
    decode = [w for w in workers if w.role == "decode"]
    rank = _tie_ranks(decode, rng)
    hits = hit_blocks if prompt_blocks and any((hit_blocks or {}).values()) else {}

    def key(w: WorkerInfo) -> tuple:
        score = 0.0
        if hits or lora is not None:
            used = 1.0 - w.num_free_blocks / w.num_total_blocks if w.num_total_blocks else 1.0
            hit = hits.get(w.worker_id, 0) / prompt_blocks if hits else 0.0
            score = DECODE_HIT_WEIGHT * hit - used + DECODE_LORA_WEIGHT * _held(w, lora)
        return (-score, -w.num_free_blocks, w.num_running, rank[w.worker_id])

    return min(decode, key=key, default=None)


def pick_prefill(
    workers: Iterable[WorkerInfo], hit_blocks: Mapping[str, int] | None = None,
    prompt_blocks: int = 0, lora: str | None = None, in_flight: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
) -> WorkerInfo | None:
    """The prefill worker by the NOTE's score (`hit_blocks`: worker_id -> leading prompt blocks
    it holds, of `prompt_blocks`; `in_flight`: address -> the caller's calls in flight there);
    without hits, the shortest queue, ties to more free KV blocks, then at random (`rng`;
    without it, the smaller worker_id); `lora`, the request's adapter, favours the workers
    holding it. Workers of other roles are ignored; None if there is none."""
    prefill = [w for w in workers if w.role == "prefill"]
    if not prefill:
        return None
    rank = _tie_ranks(prefill, rng)

    def key(w: WorkerInfo) -> tuple:
        queue = max(w.num_waiting + w.num_running, (in_flight or {}).get(w.address, 0))
        hit = (hit_blocks or {}).get(w.worker_id, 0) / prompt_blocks if prompt_blocks else 0.0
        score = hit - queue / (queue + QUEUE_HALF) + PREFILL_LORA_WEIGHT * _held(w, lora)
        return (-score, queue, -w.num_free_blocks, rank[w.worker_id])

    return min(prefill, key=key)


def _tie_ranks(workers: list[WorkerInfo], rng: random.Random | None) -> dict[str, int]:
    """worker_id -> its place in the tie-break order: a random permutation drawn from `rng`, or
    by worker_id without one."""
    ids = sorted(w.worker_id for w in workers)
    if rng is not None:
        rng.shuffle(ids)
    return {wid: i for i, wid in enumerate(ids)}


def _held(w: WorkerInfo, lora: str | None) -> int:
    """1 when `w` lists the adapter `lora` among those it holds, else 0 (also for no adapter)."""
    return int(lora is not None and lora in w.lora_adapters)


def pick_round_robin(workers: Iterable[WorkerInfo], role: str, turn: int) -> WorkerInfo | None:
    """The `turn`-th worker of `role` (by worker_id, cyclically); None if there is none."""
    of_role = sorted((w for w in workers if w.role == role), key=lambda w: w.worker_id)
    return of_role[turn % len(of_role)] if of_role else None
