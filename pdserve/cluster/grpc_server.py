"""What every pdserve gRPC service shares: one error-mapping interceptor, the standard health
service, channel/server options that keep messages to a few MiB, and a serve loop that drains
on SIGTERM.

Servicers stay thin: they raise plain Python exceptions and `ErrorInterceptor` turns them into
gRPC status codes with the exception's message, so clients always get a reason.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cluster.tls import PLAINTEXT, TLSConfig, channel

logger = logging.getLogger(__name__)

# KV slabs are a few MiB (2 by default): head-room for the header, limits nowhere near the maximum.
MAX_MESSAGE_BYTES = 16 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


class NotFoundError(KeyError):
    """The named request (or worker) is not known here."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class PreconditionError(RuntimeError):
    """The call names something that no longer holds here (a KV pool of an earlier process)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a servicer exception maps to."""
    from engine.kv_handoff import KVCacheFullError
    from pdserve.cluster.cancel import RequestCancelled

    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, PreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, RequestCancelled):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, KVCacheFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, ConnectionError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a handler to a status code and message (unary and streaming)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, method))
        return handler


def status_of(exc: BaseException, what: str) -> tuple[grpc.StatusCode, str]:
    """The status code and details a servicer exception ends its call with (a request on a
    shared stream ends with the same), logged under `what`: INTERNAL with its traceback."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("%s failed", what, exc_info=exc)
        return code, f"{type(exc).__name__}: {exc}"
    logger.info("%s: %s: %s", what, code.name, exc)
    return code, str(exc)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    await context.abort(*status_of(exc, method))


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await _abort(context, exc, method)

    return wrapped


def _wrap_stream(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in fn(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, method)

    return wrapped


async def make_server(
    service_name: str, add_servicers: Callable[[grpc.aio.Server], None],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with `interceptors` (outermost first), the error interceptor and the
    standard health service; the server and `service_name` report NOT_SERVING until
    `set_serving` is called."""
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()],
                             options=GRPC_OPTIONS)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


async def set_serving(
    health_servicer: health.aio.HealthServicer, service_name: str, serving: bool = True
) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else (
        health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", service_name):
        await health_servicer.set(name, status)


def open_channel(address: str, tls: TLSConfig = PLAINTEXT) -> grpc.aio.Channel:
    """A channel with pdserve's options, over TLS when `tls` is configured."""
    return channel(address, tls, GRPC_OPTIONS)


async def check_health(
    address: str, service: str = "", timeout: float = 2.0, tls: TLSConfig = PLAINTEXT
) -> bool:
    """True when the server at `address` reports SERVING through the standard health rpc."""
    async with open_channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = await stub.Check(request, timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def serve_until_signal(
    server: grpc.aio.Server, on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 10.0,
) -> None:
    """Run `server` until SIGTERM/SIGINT, then stop admitting and give in-flight calls `grace_s`."""
    await wait_for_signal()
    logger.info("stopping: draining for up to %.0f s", grace_s)
    if on_stop is not None:
        await on_stop()
    await server.stop(grace_s)


async def wait_for_signal() -> None:
    """Return on the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
