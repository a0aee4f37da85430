"""The engine's periodic stats line in a serving process's log, as vLLM prints it: every
`--log-stats-interval` seconds while anything happened since the last line (`--disable-log-stats`
turns it off):

    Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%
    SpecDecoding metrics: Mean acceptance length: 2.41, Accepted: 82 tokens, Drafted: 120
    tokens, Per-position acceptance rate: 0.800, 0.550, 0.400

Rates (hit rate, acceptance) are over the interval, from the engine's cumulative counters.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable

from engine.scheduler_output import SchedulerStats
from pdserve.cluster.flags import add_flag

logger = logging.getLogger("pdserve.stats")


def add_stats_log_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--disable-log-stats", False, action="store_true",
             help="no periodic stats line in the log")
    add_flag(parser, "--log-stats-interval", 5.0, type=float,
             help="seconds between stats lines (printed only when something happened)")


def stats_lines(before: SchedulerStats | None, now: SchedulerStats) -> list[str]:
    """The lines for the interval from `before` (None: since the start) to `now`; none when
    nothing ran, waited or was computed in it."""
    def since(name: str) -> int:  # the counter's growth over the interval
        return getattr(now, name) - (getattr(before, name) if before else 0)

    queries, hits = since("prefix_cache_queries"), since("prefix_cache_hits")
    drafts = since("spec_decode_num_drafts")
    busy = now.num_running or now.num_waiting or queries or drafts
    if not busy and before is not None and not (before.num_running or before.num_waiting):
        return []
    lines = [f"Running: {now.num_running} reqs, Waiting: {now.num_waiting} reqs, KV cache usage: "
             f"{100 * now.kv_cache_usage:.1f}%, Prefix cache hit rate: "
             f"{100 * hits / queries if queries else 0.0:.1f}%"]
    if drafts:
        accepted = since("spec_decode_num_accepted_tokens")
        old = before.spec_decode_num_accepted_tokens_per_pos if before else ()
        per_pos = [n - (old[j] if j < len(old) else 0)
                   for j, n in enumerate(now.spec_decode_num_accepted_tokens_per_pos)]
        rates = ", ".join(f"{n / drafts:.3f}" for n in per_pos)
        lines.append(
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {since('spec_decode_num_draft_tokens')} "
            f"tokens, Per-position acceptance rate: {rates}")
    return lines


async def log_stats_forever(stats: Callable[[], Awaitable[SchedulerStats]],
                            interval_s: float) -> None:
    """Log `stats_lines` every `interval_s` seconds until cancelled."""
    before: SchedulerStats | None = None
    while True:
        await asyncio.sleep(interval_s)
        try:
            now = await stats()
        except Exception:  # the engine failed: the worker's own watcher reports it
            return
        for line in stats_lines(before, now):
            logger.info("%s", line)
        before = now


def start_stats_log(args: argparse.Namespace,
                    stats: Callable[[], Awaitable[SchedulerStats]]) -> asyncio.Task | None:
    if args.disable_log_stats or args.log_stats_interval <= 0:
        return None
    return asyncio.get_running_loop().create_task(
        log_stats_forever(stats, args.log_stats_interval), name="stats-log")
