"""Driving the load: warm-up, then one timed run per request rate of the sweep.

NOTE: a run sends its requests at the arrival process's offsets, each as its own task; with
--max-concurrency a semaphore holds a due request back until a slot frees (the wait is queueing
in the client: it shows in `sent_at - scheduled_at`, not in TTFT, as in vLLM's benchmark).
With --client-processes N the requests of a run go out from N processes
(loadtest/processes.py), where one would measure its own client. Every run is bounded:
`len(specs)` requests at most, and --max-duration seconds of wall time, after which the
requests still in flight are cancelled (recorded as failed) and those never sent are counted
apart (`not_sent`). With --metrics-url, the server's own counters are read before and after
each run, and their increase reported (`server_counters`). Each rate of a sweep gets its own
slice of the workload, so a later rate never re-sends a prompt an earlier one left in the
server's prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest import scrape
from loadtest.arrivals import arrival_offsets
from loadtest.client import StreamClient
from loadtest.metrics import SLO, run_metrics
from loadtest.processes import ClientProcesses
from loadtest.record import RequestRecord
from loadtest.sending import NoBar, send_within, sender
from loadtest.workloads import RequestSpec


@dataclass(frozen=True)
class RunConfig:
    rates: tuple[float, ...] = (math.inf,)
    num_prompts: int = 100  # per rate
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    max_duration_s: float = 600.0  # per rate
    seed: int = 0
    slo: SLO = SLO()
    progress: bool = True
    metrics_urls: tuple[str, ...] = ()  # Prometheus pages whose counters each run reports
    client_processes: int = 1  # >1: each run's requests sent from that many processes

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"request rates must be > 0 (inf: all at once), got {self.rates}")
        if self.num_prompts < 1 or self.num_warmups < 0:
            raise ValueError("num_prompts must be >= 1 and num_warmups >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.max_duration_s > 0:
            raise ValueError(f"max_duration_s must be > 0, got {self.max_duration_s}")
        if self.client_processes < 1:
            raise ValueError(f"client_processes must be >= 1, got {self.client_processes}")

    @property
    def total_requests(self) -> int:
        """Requests the workload must hold: the warm-ups, then one slice per rate."""
        return self.num_warmups + self.num_prompts * len(self.rates)


async def sweep(client: StreamClient, specs: Sequence[RequestSpec],
                cfg: RunConfig) -> list[dict[str, Any]]:
    """Warm up, then one run per rate; each run's metrics and records."""
    if len(specs) < cfg.total_requests:
        raise ValueError(f"{len(specs)} requests for {cfg.total_requests} needed")
    await warm_up(client, specs[:cfg.num_warmups], cfg.max_concurrency)
    with contextlib.ExitStack() as stack:
        processes = None if cfg.client_processes == 1 else stack.enter_context(
            ClientProcesses(client.cfg, client.model, cfg.client_processes))
        results = []
        for i, rate in enumerate(cfg.rates):
            start = cfg.num_warmups + i * cfg.num_prompts
            results.append(await run_rate(client, specs[start:start + cfg.num_prompts], rate,
                                          cfg, processes))
    return results


async def warm_up(client: StreamClient, specs: Sequence[RequestSpec],
                  max_concurrency: int | None) -> None:
    """Send `specs` (concurrently, bounded), untimed. Raises RuntimeError if one fails: a
    server that fails its warm-up is not worth measuring."""
    slots = asyncio.Semaphore(max_concurrency or max(1, len(specs)))
    records = [RequestRecord(i, s.prompt_len, s.output_len) for i, s in enumerate(specs)]

    async def one(spec: RequestSpec, record: RequestRecord) -> None:
        async with slots:
            await client.send(spec, record, time.perf_counter)

    await asyncio.gather(*(one(s, r) for s, r in zip(specs, records)))
    if failed := [r.error for r in records if not r.ok]:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


async def run_rate(client: StreamClient, specs: Sequence[RequestSpec], rate: float,
                   cfg: RunConfig, processes: ClientProcesses | None = None) -> dict[str, Any]:
    """One timed run of `specs` at `rate` requests/s: its metrics, then its records. With
    `processes`, they send the requests (loadtest/processes.py), this one only reads the
    counters."""
    offsets = arrival_offsets(len(specs), rate, cfg.arrival, cfg.burstiness, cfg.seed)
    records = [RequestRecord(i, s.prompt_len, s.output_len, scheduled_at=t)
               for i, (s, t) in enumerate(zip(specs, offsets))]
    counters = await scrape.read_counters(client.http, cfg.metrics_urls)
    load_start, t0 = _load_average(), time.perf_counter()
    if processes is not None:
        t0, timed_out = await processes.send_all(specs, records, cfg.max_concurrency,
                                                 cfg.max_duration_s)
    else:
        clock = lambda: time.perf_counter() - t0
        async with _progress(len(specs), f"rate {rate:g}/s", cfg.progress) as bar:
            send = sender(client, cfg.max_concurrency or len(specs), clock, bar)
            timed_out = await send_within(specs, records, send, clock, cfg.max_duration_s)
    duration = time.perf_counter() - t0
    sent = [r for r in records if r.done_at > 0]  # set by the client once it sent a request
    counters = scrape.deltas(counters, await scrape.read_counters(client.http, cfg.metrics_urls))
    return {
        "request_rate": rate, "arrival": cfg.arrival, "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency, "timed_out": timed_out,
        "not_sent": len(records) - len(sent), "load_avg_1m": [load_start, _load_average()],
        **run_metrics(sent, duration, cfg.slo),
        **prefix_reuse(specs, sent, counters),
        "server_counters": counters,
        "requests": [r.to_json() for r in sent],
    }


# The servers' prefix-cache hits, in tokens (pdserve's workers; vLLM)
HIT_COUNTERS = ("pdserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total")


def prefix_reuse(specs: Sequence[RequestSpec], sent: list[RequestRecord],
                 counters: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Prompt tokens of the sent requests that an earlier request of the workload sent too
    (what a prefix cache could hit), the hits the --metrics-url pages counted meanwhile, and
    their ratio (None without hittable tokens or without those pages). Warm-ups and earlier
    rates may have sent a prefix first: hits can exceed what this run calls hittable."""
    hittable = sum(specs[r.index].reused_len for r in sent)
    hits = sum(page.get(name, 0.0) for page in counters.values() for name in HIT_COUNTERS)
    rate = hits / hittable if hittable and counters else None
    return {"reused_prompt_tokens": hittable, "prefix_cache_hit_tokens": hits,
            "prefix_hit_rate": rate}


def _load_average() -> float | None:
    """The host's 1-minute load average (other processes skew the timings), where known."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@contextlib.asynccontextmanager
async def _progress(total: int, desc: str, enabled: bool) -> AsyncIterator[Any]:
    """A tqdm bar of completed requests (none when disabled or tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield NoBar()
        return
    bar = tqdm(total=total, desc=desc, unit="req", leave=True)
    try:
        yield bar
    finally:
        bar.close()
