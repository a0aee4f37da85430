"""Calls from the engine thread onto event loops, one hop per loop.

NOTE: `loop.call_soon_threadsafe` writes to the loop's self-pipe (a syscall) and queues a
callback. The engine thread hands each step's outputs (engine/async_engine.py) and, in the
prefill role, each moment's KV progress notes (engine/kv_progress.py) to the loops that read
them; one hop per request was 17-25% of the process's CPU per streamed token with 256 streams
on the CPU box (pdserve.bench.async_streams). So the calls of one moment go together:

    [(loop A, f, x), (loop B, g, y), (loop A, h, z)] ─▶ A: f(x), h(z)   B: g(y)   (in order)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

Call = tuple[asyncio.AbstractEventLoop, Callable[[Any], Any], Any]


def call_on_loops(calls: Iterable[Call]) -> None:
    """Run each `fn(arg)` on its loop, in order per loop, with one `call_soon_threadsafe` per
    loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], Any], Any]]] = {}
    for loop, fn, arg in calls:
        by_loop.setdefault(loop, []).append((fn, arg))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_run_all, items)


def _run_all(items: list[tuple[Callable[[Any], Any], Any]]) -> None:
    for fn, arg in items:
        fn(arg)
