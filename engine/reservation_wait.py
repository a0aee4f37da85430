"""A decode reservation's wait for its KV blocks, on the caller's side: one piece for
`AsyncLLMEngine` (the engine in a thread) and `DecodeCoreClient` (in a process of its own).

The reserve command answers the blocks, or None: queued for free blocks, first come first
served, whose grant later settles `granted` (None there: aborted while queued). Past
`wait.seconds` the request is aborted (out of the queue, or its blocks freed if just granted)
and KVCacheFullError raised; a caller cancelled meanwhile keeps nothing either (the abort is
sent behind the reserve, which may still be in the engine's queue).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from engine.config import KVWaitConfig
from engine.kv_handoff import KVCacheFullError, Reservation
from engine.request_streams import RequestStreams


async def await_reservation(
    request_id: str, reserve: Awaitable[Reservation | None], granted: asyncio.Future,
    wait: KVWaitConfig, streams: RequestStreams, abort: Callable[[], Awaitable[Any]],
    abort_soon: Callable[[], None],
) -> Reservation | None:
    """The blocks `reserve` answers or `granted` later gets; None if aborted while queued.
    The request's stream (opened by the caller) is discarded on any failure."""
    try:
        reservation = await reserve
        if reservation is None:
            reservation = await asyncio.wait_for(granted, wait.seconds)
    except TimeoutError:
        await abort()  # out of the queue, or its blocks freed if just granted
        raise KVCacheFullError(
            f"no room for request {request_id!r}: its KV blocks were not free within "
            f"{wait.seconds:g} s"
        ) from None
    except asyncio.CancelledError:
        streams.discard(request_id)
        abort_soon()  # the reservation may still be queued: release it after
        raise
    except BaseException:
        streams.discard(request_id)
        raise
    return reservation
