"""One run's requests sent from several client processes (--client-processes).

NOTE: why. One asyncio process opens every connection, writes every request and parses every
streamed chunk (96 requests x 128 chunks at rate inf) on one core. On the GPU machines that
front alone took 420-480 ms before the server's handler began at saturation, near the 500 ms
TTFT SLO, for the colocated server and the split alike: the load test measured its client.
Split over N processes, each sends every N-th request at its own arrival offset, on a clock
they share (time.perf_counter is CLOCK_MONOTONIC, one per host), with a client of its own:

    parent: t0 = now + lead ─▶ job k: requests k, k + N, ... ─▶ process k sleeps to t0 +
            scheduled_at, sends, records (times from t0) ─▶ records back, merged by index

The processes start (and import) once per sweep, before the first run's t0. The lead gives
them time to unpickle the job; a request is still due at t0 + scheduled_at, so it only
shifts the run's origin. --max-concurrency bounds the requests in flight per process (a due
request waits for a slot of its own process).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from loadtest.client import ClientConfig, StreamClient
from loadtest.record import RequestRecord
from loadtest.sending import send_within, sender
from loadtest.workloads import RequestSpec

LEAD_S = 0.25  # from the jobs' submission to the run's origin


class ClientProcesses:
    """N client processes for the runs of a sweep (a context manager)."""

    def __init__(self, cfg: ClientConfig, model: str, processes: int) -> None:
        if processes < 2:
            raise ValueError(f"client processes must be >= 2 here, got {processes}")
        self.cfg, self.model, self.processes = cfg, model, processes
        self.pool = ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"))

    def __enter__(self) -> ClientProcesses:
        # every process started and its imports done before a run's origin is set
        list(self.pool.map(_ready, range(self.processes)))
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(cancel_futures=True)

    async def send_all(self, specs: Sequence[RequestSpec], records: list[RequestRecord],
                       max_concurrency: int | None, max_duration_s: float
                       ) -> tuple[float, bool]:
        """Send every request at its `scheduled_at` from the processes, filling `records`:
        (the run's origin on time.perf_counter, whether --max-duration cut it short)."""
        t0 = time.perf_counter() + LEAD_S
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(
            self.pool, _send_share, self.cfg, self.model,
            [(specs[i], records[i]) for i in range(k, len(specs), self.processes)],
            t0, max_concurrency, max_duration_s) for k in range(self.processes)]
        timed_out = False
        for done, cut in await asyncio.gather(*jobs):
            timed_out |= cut
            for record in done:
                records[record.index] = record
        return t0, timed_out


def _ready(_: int) -> bool:
    return True


def _send_share(cfg: ClientConfig, model: str, share: list[tuple[RequestSpec, RequestRecord]],
                t0: float, max_concurrency: int | None, max_duration_s: float
                ) -> tuple[list[RequestRecord], bool]:
    """In a client process: this share's requests at their offsets from `t0`; its records,
    and whether --max-duration cut it short (the requests still in flight then are recorded
    as cancelled, those never sent keep done_at 0)."""

    async def run() -> bool:
        clock = lambda: time.perf_counter() - t0
        async with StreamClient(replace(cfg, model=model), max_concurrency) as client:
            send = sender(client, max_concurrency or max(1, len(share)), clock)
            return await send_within([s for s, _ in share], [r for _, r in share], send,
                                     clock, max(0.0, max_duration_s - clock()))

    cut = asyncio.run(run())
    return [record for _, record in share], cut
