"""Sending a run's requests at their arrival offsets: the one-process run's
(loadtest/runner.py) and each client process's share (loadtest/processes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from loadtest.client import StreamClient
from loadtest.record import RequestRecord
from loadtest.workloads import RequestSpec

Send = Callable[[RequestSpec, RequestRecord], Awaitable[None]]


class NoBar:
    def update(self, n: int) -> None:
        pass


def sender(client: StreamClient, slots: int, clock: Callable[[], float],
           bar: Any = None) -> Send:
    """Send one request once one of `slots` is free; tick the progress bar (if any) when it
    is done."""
    semaphore = asyncio.Semaphore(slots)
    bar = bar or NoBar()

    async def send(spec: RequestSpec, record: RequestRecord) -> None:
        async with semaphore:
            await client.send(spec, record, clock)
        bar.update(1)

    return send


async def send_all(specs: Sequence[RequestSpec], records: list[RequestRecord], send: Send,
                   clock: Callable[[], float]) -> None:
    """Start each request at its `scheduled_at`, then wait for all. Cancelled (the time bound),
    it cancels every request it started."""
    tasks: list[asyncio.Task[None]] = []
    try:
        for spec, record in zip(specs, records):
            if (delay := record.scheduled_at - clock()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(spec, record)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def send_within(specs: Sequence[RequestSpec], records: list[RequestRecord], send: Send,
                      clock: Callable[[], float], seconds: float) -> bool:
    """`send_all` for at most `seconds`: whether that bound cut it short."""
    try:
        await asyncio.wait_for(send_all(specs, records, send, clock), seconds)
        return False
    except asyncio.TimeoutError:
        return True
