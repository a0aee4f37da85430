"""A worker's graceful stop: leave the registry, keep serving a moment, refuse new requests,
let the ones it holds finish, then stop.

NOTE: the order on SIGTERM (`drain`), each step bounded by --drain-timeout in all:

    1. deregister; gRPC health NOT_SERVING    gateways stop picking this worker
    2. pause (`pause_s`, about a second)       a gateway that read the registry a moment before
                                               still gets in: no UNAVAILABLE for it
    3. close the gate                          new admissions (Generate, GenerateStreams and
                                               the requests opened on one, Prefill,
                                               PrefillStreams and the Prefills opened on one)
                                               get UNAVAILABLE, which the gateway treats as
                                               retryable; a GenerateStreams or PrefillStreams
                                               call ends once its requests did; every other
                                               call (Reserved, PushKV for a held request,
                                               Abort, GetLoad) still gets in
    4. wait until idle                         no call in flight and no background work (a
                                               prefill worker's KV pushes)
    5. `on_stop` (cancel watch, KV sender, ...), then `server.stop`: anything left is cut off
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)

ADMISSIONS = frozenset({"/pdserve.v1.Decode/Generate", "/pdserve.v1.Decode/GenerateStreams",
                        "/pdserve.v1.Prefill/Prefill", "/pdserve.v1.Prefill/PrefillStreams"})
_UNCOUNTED_PREFIX = "/grpc.health.v1.Health/"
MAX_PAUSE_S = 1.0


def pause_for(drain_timeout_s: float) -> float:
    """The pause between deregistering and refusing admissions: a second, or a quarter of the
    drain timeout when that is shorter."""
    return min(MAX_PAUSE_S, drain_timeout_s / 4)


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts the calls in flight (health checks aside) and, once `close`d, refuses new calls
    to the `admissions` methods with UNAVAILABLE. Runs on the server's event loop only."""

    def __init__(self, admissions: frozenset[str] = ADMISSIONS) -> None:
        self.admissions = admissions
        self.admitting = True
        self.in_flight = 0
        # set by `close`: a long-lived call admitting many requests (GenerateStreams) stops
        # admitting on it too, and ends once the requests it holds ended
        self.closing = asyncio.Event()

    def close(self) -> None:
        """Refuse new admissions from now on (calls in flight go on)."""
        self.admitting = False
        self.closing.set()

    async def wait_idle(self, timeout_s: float, busy: Callable[[], bool] = lambda: False,
                        poll_s: float = 0.02) -> bool:
        """Until no call is in flight and `busy()` is false, at most `timeout_s`. True if idle."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight or busy():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_UNCOUNTED_PREFIX):
            return handler
        gated = method in self.admissions
        for kind in ("unary_unary", "stream_unary"):
            if getattr(handler, kind):
                return handler._replace(**{kind: self._unary(getattr(handler, kind), gated)})
        for kind in ("unary_stream", "stream_stream"):
            if getattr(handler, kind):
                return handler._replace(**{kind: self._stream(getattr(handler, kind), gated)})
        return handler

    async def _admit(self, gated: bool, context: grpc.aio.ServicerContext) -> None:
        if gated and not self.admitting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")

    def _unary(self, fn: Callable[..., Awaitable[Any]], gated: bool) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._admit(gated, context)
            self.in_flight += 1
            try:
                return await fn(request, context)
            finally:
                self.in_flight -= 1

        return wrapped

    def _stream(self, fn: Callable[..., Any], gated: bool) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._admit(gated, context)
            self.in_flight += 1
            try:
                async for item in fn(request, context):
                    yield item
            finally:
                self.in_flight -= 1

        return wrapped


async def drain(
    gate: DrainGate, server: grpc.aio.Server, timeout_s: float,
    deregister: Callable[[], Awaitable[None]], on_stop: Callable[[], Awaitable[None]],
    busy: Callable[[], bool] = lambda: False,
) -> None:
    """The graceful stop of the NOTE above, within `timeout_s`. `deregister` takes the worker
    out of the registry and its health check; `busy` tells of work no call accounts for."""
    deadline = time.monotonic() + timeout_s
    await deregister()
    await asyncio.sleep(pause_for(timeout_s))
    gate.close()
    logger.info("draining: admissions closed, %d calls in flight", gate.in_flight)
    idle = await gate.wait_idle(max(0.0, deadline - time.monotonic()), busy)
    if not idle:
        logger.warning("drain timeout: %d calls still in flight are cut off", gate.in_flight)
    await on_stop()
    await server.stop(max(0.0, min(1.0, deadline - time.monotonic())))
