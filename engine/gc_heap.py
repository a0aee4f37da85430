"""The start-up heap kept out of the garbage collector's full collections.

NOTE: why. A full (generation 2) collection walks every tracked object: with torch,
transformers and an engine loaded that is ~0.5M objects and 0.2-0.3 s, and Python runs one
whenever the objects that survived two younger collections reach a quarter of the old ones. On
the H100's W1 throughput benchmark one such pause (0.29-0.37 s) landed in one run of every
two, a quarter of that run's time. Objects moved to the permanent generation (`gc.freeze`) are
never walked, so after it a full collection costs what serving allocated since (vLLM's engine
core freezes its heap after start-up too).

A server process freezes its own heap too once it serves (`serving_process_ready`: the gateway
and `pdserve serve`'s HTTP processes, every gRPC worker, the tokenizer): a decode worker whose
engine runs in a process of its own still imports torch and grpc (~0.2M objects; a full
collection took 70-80 ms on the CPU box), and every stream's tokens pass through it, so one
collection there stopped every stream of the cluster at once (the one-H100 load test of
2026-12-06: 80-85 ms without a chunk on any of 96 streams, right after the burst's prefills).

A frozen object is still freed when its reference count drops; only reference cycles among
frozen objects stay until they are unfrozen. So each engine's start-up first unfreezes and
collects what earlier engines of the process left (the test suite builds hundreds in one
process), and an engine's shutdown unfreezes.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect everything (earlier frozen heaps included), then freeze what survives."""
    start = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    logger.debug("froze %d objects out of the collector's sight in %.3f s",
                 gc.get_freeze_count(), time.perf_counter() - start)


def serving_process_ready(role: str) -> None:
    """A server process is built and about to serve: freeze its start-up heap, and note its
    collections when PDSERVE_STEP_TIMELINE is set (engine/step_timeline.py)."""
    from engine.step_timeline import watch_collections

    freeze_startup_heap()
    watch_collections(role)


def unfreeze_heap() -> None:
    """Give the frozen objects back to the collector (their cycles become collectable)."""
    gc.unfreeze()
