"""The periodic stats line (vLLM's format) from two snapshots of the engine's counters."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from engine.scheduler_output import SchedulerStats
from pdserve.cluster.stats_log import log_stats_forever, stats_lines

IDLE = SchedulerStats(num_running=0, num_waiting=0, num_free_blocks=10, num_total_blocks=10,
                      kv_cache_usage=0.0, num_preemptions=0, prefix_cache_queries=0,
                      prefix_cache_hits=0)


def test_lines_over_the_interval():
    busy = dataclasses.replace(
        IDLE, num_running=3, num_waiting=1, kv_cache_usage=0.125, prefix_cache_queries=200,
        prefix_cache_hits=80, spec_decode_num_drafts=40, spec_decode_num_draft_tokens=120,
        spec_decode_num_accepted_tokens=82, spec_decode_num_accepted_tokens_per_pos=(32, 30, 20))
    assert stats_lines(IDLE, busy) == [
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%",
        "SpecDecoding metrics: Mean acceptance length: 3.05, Accepted: 82 tokens, Drafted: 120 "
        "tokens, Per-position acceptance rate: 0.800, 0.750, 0.500",
    ]
    later = dataclasses.replace(busy, prefix_cache_queries=300, prefix_cache_hits=80)
    assert stats_lines(busy, later)[0].endswith("Prefix cache hit rate: 0.0%")  # the interval's
    assert len(stats_lines(busy, later)) == 1  # no drafts in it
    done = dataclasses.replace(later, num_running=0, num_waiting=0)
    assert len(stats_lines(later, done)) == 1  # the line that shows it drained
    assert stats_lines(done, done) == []  # quiet: nothing printed


def test_the_task_logs_only_when_something_happened(caplog):
    snapshots = iter([IDLE, dataclasses.replace(IDLE, num_running=2), IDLE, IDLE, IDLE])

    async def stats() -> SchedulerStats:
        return next(snapshots)

    async def go() -> None:
        task = asyncio.create_task(log_stats_forever(stats, 0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="pdserve.stats"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.stats"]
    assert lines == ["Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
                     "Prefix cache hit rate: 0.0%",
                     "Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
                     "Prefix cache hit rate: 0.0%",
                     "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
                     "Prefix cache hit rate: 0.0%"]
