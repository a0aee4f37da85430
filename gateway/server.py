"""`pdserve gateway` (in front of gRPC workers) and `pdserve serve` (one in-process engine)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn

from engine.gc_heap import serving_process_ready
from pdserve.cluster.flags import (
    add_chat_template_flag,
    add_engine_core_flag,
    add_flag,
    add_generate_streams_flag,
    add_prefill_streams_flag,
    add_redis_namespace_flag,
    add_tls_flags,
)
from pdserve.cluster.lora import add_lora_flags, parse_lora_modules

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine
    from gateway.lora import LoRAModels
    from gateway.remote_backend import RemoteBackend
    from gateway.tools.plan import ToolCallConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--host", "127.0.0.1", help="interface to bind")
    add_flag(p, "--port", 8000, type=int, help="HTTP port")
    add_flag(p, "--api-key", "", help="require this bearer key on /v1 routes, /tokenize, "
             "/detokenize and /workers")
    add_flag(p, "--max-body-bytes", 16 << 20, type=int,
             help="largest request body accepted (larger: 413)")
    add_flag(p, "--trust-request-chat-template", False, action="store_true",
             help="run a chat_template sent in a request (else 400: it is code)")
    add_flag(p, "--log-level", "info", help="debug, info, warning, error")
    add_flag(p, "--drain-timeout", 30.0, type=float,
             help="seconds in-flight requests (streams too) get to finish after SIGTERM")
    add_flag(p, "--keep-alive-seconds", 15.0, type=float,
             help="how long an idle client connection stays open; longer than the 5 s after "
                  "which httpx/openai clients stop reusing one, so the gateway never closes a "
                  "connection just as a client sends on it")
    add_flag(p, "--max-concurrent-requests", 0, type=int,
             help="generation requests in flight past which new ones get 429 at once (0: no "
                  "limit)")
    add_flag(p, "--enable-auto-tool-choice", False, action="store_true",
             help='serve tool_choice "auto" (the default with tools): the model\'s own tool '
                  "calls, read by --tool-call-parser")
    add_flag(p, "--tool-call-parser", "",
             help="how the model writes tool calls: hermes, smollm2 (= hermes), llama3_json")
    add_flag(p, "--reuse-port", False, action="store_true",
             help="bind with SO_REUSEPORT, so several gateway processes serve one port "
                  "(`pdserve up --api-server-count`)")


def tool_call_config(args: argparse.Namespace) -> ToolCallConfig:
    """--enable-auto-tool-choice and --tool-call-parser (ValueError for an unknown parser, or
    auto tool choice without one)."""
    from gateway.tools.plan import ToolCallConfig

    return ToolCallConfig(args.enable_auto_tool_choice, args.tool_call_parser or None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_gateway_flags(p)
    add_flag(p, "--served-model-name", "", help="model name in the OpenAI API")
    add_flag(p, "--redis-url", "redis://127.0.0.1:6379/0", help="registry and request state")
    add_redis_namespace_flag(p)
    add_flag(p, "--tokenizer-address", "",
             help="host:port of the tokenizer (default: the one in the registry)")
    add_flag(p, "--local-prefill-max-tokens", 0, type=int,
             help="prompts up to this many tokens prefill on the decode worker (0: never)")
    add_flag(p, "--routing", "kv_aware", choices=["kv_aware", "load", "round_robin"],
             help="how requests pick workers: kv_aware (prefill workers holding the prompt's "
                  "prefix, against load), load, round_robin")
    add_generate_streams_flag(p)
    add_prefill_streams_flag(p)
    add_flag(p, "--max-migrations", 2, type=int,
             help="worker failures one request survives: its stream moves to another decode "
                  "worker, its prefill to another prefill worker (0: fail it)")
    add_flag(p, "--resume-ttl-seconds", 300, type=int,
             help="how long a streamed response's events stay in Redis after its last one, "
                  "for a client to resume it (GET /v1/streams/{id}, Last-Event-ID); 0: streams "
                  "are not recorded (no Redis writes per token; none can be resumed)")
    add_flag(p, "--resume-write-interval-ms", 10.0, type=float,
             help="a recorded stream's events go to Redis in one call per this interval (and "
                  "round trip) for all the gateway's streams: longer, fewer calls; a gateway "
                  "that dies loses this much of its streams' recording (a resume generates "
                  "it again)")
    add_flag(p, "--response-ttl-seconds", 3600, type=int,
             help="how long a stored /v1/responses response stays in Redis (for "
                  "previous_response_id and GET /v1/responses/{id})")
    add_tls_flags(p)
    add_lora_flags(p, engine=False)  # the workers hold the adapters; Redis, their names


async def _serve_app(app: object, args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT, then let in-flight requests (streams too) finish for up to
    --drain-timeout. A SIGTERM'd gateway returns from here once drained: the process exits 0."""
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout,
                            timeout_keep_alive=args.keep_alive_seconds)
    server = uvicorn.Server(config)
    sockets = [reuse_port_socket(args.host, args.port)] if args.reuse_port else None
    # uvicorn handles SIGTERM while it serves (a graceful shutdown); once done, it puts back the
    # handler it found and raises the signal again, which with the default handler would kill
    # the drained process (exit -15). Found here instead: a stop request, nothing more.
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    serving_process_ready("http")
    try:
        await (server.serve() if sockets is None else server.serve(sockets=sockets))
    finally:
        signal.signal(signal.SIGTERM, previous)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT: every process that binds one the
    same way listens on the port, and the kernel hands each new connection to one of them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def stream_log(client: Any, args: argparse.Namespace) -> Any:
    """Where streams are recorded for resuming (an EventLog on `client`), or None with
    --resume-ttl-seconds 0: no Redis write per decode step, and no stream can be resumed."""
    from pdserve.cluster.event_log import EventLog

    if args.resume_ttl_seconds < 0:
        raise ValueError(f"--resume-ttl-seconds must be >= 0, got {args.resume_ttl_seconds}")
    if not args.resume_ttl_seconds:
        return None
    try:
        return EventLog(client, prefix=args.redis_namespace, ttl_s=args.resume_ttl_seconds,
                        write_interval_s=args.resume_write_interval_ms / 1e3)
    except ValueError as exc:  # EventLog's bounds, named as the flag
        raise ValueError(f"--resume-write-interval-ms {args.resume_write_interval_ms}: "
                         f"{exc}") from exc


async def serve_disaggregated(args: argparse.Namespace) -> None:
    from gateway.app import build_app
    from gateway.metrics import GatewayMetrics
    from gateway.remote_backend import RemoteBackend
    from pdserve.cluster.registry import WorkerRegistry
    from pdserve.cluster.response_store import RedisResponses
    from pdserve.cluster.state import RequestStore, connect
    from pdserve.cluster.tls import tls_from_args

    tool_calls = tool_call_config(args)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    client = connect(args.redis_url)
    store = RequestStore(client, prefix=args.redis_namespace)
    events = stream_log(client, args)
    registry = WorkerRegistry(client, prefix=args.redis_namespace)
    address = args.tokenizer_address or await _until(
        lambda: _registered_tokenizer(registry), "a tokenizer in the registry")
    metrics = GatewayMetrics()
    backend = RemoteBackend(address, registry, store, args.local_prefill_max_tokens,
                            tls=tls_from_args(args), max_migrations=args.max_migrations,
                            metrics=metrics, routing=args.routing,
                            shared_generate=args.generate_streams == "shared",
                            shared_prefill=args.prefill_streams == "shared")
    await _until(backend.start, "the tokenizer service")
    loras = await _cluster_loras(args, client, backend) if args.enable_lora else None
    app = build_app(backend, store=store, served_model_name=args.served_model_name or None,
                    api_key=args.api_key or None,
                    max_concurrent_requests=args.max_concurrent_requests,
                    max_body_bytes=args.max_body_bytes,
                    trust_request_chat_template=args.trust_request_chat_template,
                    metrics=metrics, events=events, tool_calls=tool_calls,
                    responses=RedisResponses(client, prefix=args.redis_namespace,
                                             ttl_s=args.response_ttl_seconds), loras=loras)
    await _serve_app(app, args)
    await backend.close()


async def _cluster_loras(args: argparse.Namespace, client: Any, backend: RemoteBackend
                         ) -> LoRAModels:
    """The cluster's LoRA adapters: names in Redis (seeded from --lora-modules), loaded on
    every registered worker."""
    from gateway.lora import LoRAModels
    from gateway.remote_lora import WorkerAdapters
    from pdserve.cluster.lora_catalog import RedisCatalog

    loras = LoRAModels(RedisCatalog(client, prefix=args.redis_namespace),
                       WorkerAdapters(backend.pool))
    await loras.seed(parse_lora_modules(args.lora_modules))
    return loras


async def _registered_tokenizer(registry: object) -> str:
    workers = await registry.list_workers("tokenizer")  # type: ignore[attr-defined]
    if not workers:
        raise LookupError("no tokenizer registered yet")
    return workers[0].address


async def _until(fn: Callable[[], Awaitable[T]], what: str, timeout_s: float = 120.0) -> T:
    """`await fn()` until it succeeds (retrying every 0.5 s), at most `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await fn()
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"gave up waiting for {what}: {exc}") from exc
            await asyncio.sleep(0.5)


def add_colocated_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.cluster.worker import add_engine_flags

    add_gateway_flags(p)
    add_engine_flags(p)
    add_engine_core_flag(p)
    add_chat_template_flag(p)


def serve_colocated(args: argparse.Namespace) -> None:
    from pdserve.cluster.worker import build_engine
    from tokenizer_svc.chat_template import read_template

    tool_calls, template = tool_call_config(args), read_template(args.chat_template)
    engine = build_engine(args, "colocated")
    name = args.served_model_name or args.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
    try:
        asyncio.run(_serve_colocated(args, engine, name, template, tool_calls))
    finally:
        engine.shutdown()


async def _serve_colocated(args: argparse.Namespace, engine: AsyncLLMEngine, name: str,
                           template: str | None, tool_calls: ToolCallConfig) -> None:
    from gateway.app import build_app
    from gateway.local_backend import LocalBackend
    from gateway.lora import EngineAdapters, LoRAModels, MemoryCatalog
    from gateway.metrics import GatewayMetrics
    from pdserve.cluster.lora_service import preload_loras
    from pdserve.cluster.worker import serial_host_threads

    serial_host_threads(args)
    metrics, loras = GatewayMetrics(), None
    if args.enable_lora:  # --lora-modules loaded now: a bad adapter fails the start
        if not args.engine_core_address:  # else the engine core's own server loaded them
            await preload_loras(engine, args)
        loras = LoRAModels(MemoryCatalog(), EngineAdapters(engine))
        await loras.seed(parse_lora_modules(args.lora_modules))
        metrics.watch_engine(engine.stats, args.max_loras)
    backend = LocalBackend(engine, name, template)
    await backend.model_info()  # the tokenizer and chat template, before the first request
    app = build_app(backend, api_key=args.api_key or None,
                    max_concurrent_requests=args.max_concurrent_requests,
                    max_body_bytes=args.max_body_bytes,
                    trust_request_chat_template=args.trust_request_chat_template,
                    tool_calls=tool_calls, metrics=metrics, loras=loras)
    from pdserve.cluster.stats_log import start_stats_log

    stats_log = start_stats_log(args, engine.stats)
    try:
        await _serve_app(app, args)
    finally:
        if stats_log is not None:
            stats_log.cancel()


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve_disaggregated(args))
