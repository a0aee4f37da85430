"""What the prefill and decode workers share: engine flags, building the engine in its role,
the registry heartbeat and the Prometheus endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.config import (
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
)
from engine.gc_heap import serving_process_ready
from engine.kv_events import KVEventBatch
from engine.scheduler_output import SchedulerStats
from pdserve.cluster.cancel import CancelWatch, NoCancelWatch
from pdserve.cluster.drain import DrainGate, drain
from pdserve.cluster.flags import (
    add_common_flags,
    add_flag,
    add_model_flags,
    add_stream_interval_flag,
)
from pdserve.cluster.grpc_server import make_server, set_serving, wait_for_signal
from pdserve.cluster.lora import add_lora_flags, lora_engine_kwargs
from pdserve.cluster.lora_metrics import lora_requests_info
from pdserve.cluster.lora_service import preload_loras
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.registry import FEATURES, Heartbeat, WorkerInfo, WorkerRegistry
from pdserve.cluster.state import connect
from pdserve.cluster.stats_log import add_stats_log_flags, start_stats_log
from pdserve.cluster.tls import listen, tls_from_args

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)


def add_worker_flags(parser: argparse.ArgumentParser, port: int) -> None:
    add_common_flags(parser, port)
    add_flag(parser, "--metrics-port", 0, type=int, help="Prometheus port (0: none)")
    add_engine_flags(parser)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The model and engine flags (also those of the colocated `pdserve serve`)."""
    add_model_flags(parser)
    add_flag(parser, "--dtype", "auto", help="auto, float32, bfloat16, float16")
    add_flag(parser, "--quantization", None, choices=QUANTIZATION_CHOICES, help=QUANTIZATION_HELP)
    add_flag(parser, "--kv-cache-dtype", "auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_DTYPE_HELP)
    add_flag(parser, "--device", "auto", help="auto, cpu, cuda, cuda:N")
    add_flag(parser, "--block-size", 16, type=int, help="tokens per KV block")
    add_flag(parser, "--kv-cache-memory", None, type=int, help="KV cache bytes")
    add_flag(parser, "--num-kv-blocks", None, type=int, help="KV blocks (overrides memory)")
    add_flag(parser, "--gpu-memory-utilization", 0.9, type=float, help="GPU memory fraction")
    add_flag(parser, "--max-num-seqs", None, type=int,
             help="running requests per step (unset: 1024 on a GPU of >= 70 GiB other than an "
                  "A100, 256 on other GPUs, 64 on the CPU; engine/step_budget.py)")
    add_flag(parser, "--max-num-batched-tokens", None, type=int,
             help="tokens per step (unset: 8192 on a GPU of >= 70 GiB other than an A100, "
                  "else 2048; engine/step_budget.py)")
    add_flag(parser, "--no-prefix-caching", False, action="store_true",
              help="disable automatic prefix caching")
    add_flag(parser, "--seed", 0, type=int, help="seed of unseeded sampling")
    add_stream_interval_flag(parser)
    add_flag(parser, "--tensor-parallel-size", 1, type=int,
             help="ranks (processes) the model is sharded over: rank r uses device cuda:r of "
                  "the visible GPUs, or the CPU")
    add_flag(parser, "--enable-expert-parallel", False, action="store_true",
             help="mixture-of-experts models: whole experts per tensor-parallel rank (expert "
                  "parallelism, EP size = TP size) instead of every expert sliced across them")
    add_flag(parser, "--enforce-eager", False, action="store_true",
             help="run every step eagerly: no CUDA graphs (on CUDA they are captured at start)")
    add_flag(parser, "--distributed-timeout-seconds", 60.0, type=float,
             help="seconds a collective may wait for a rank before the worker fails")
    add_flag(parser, "--speculative-config", "",
             help='speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", '
                  '"num_speculative_tokens": 3, "prompt_lookup_max": 4} (prefill role: ignored)')
    add_lora_flags(parser)
    add_stats_log_flags(parser)


def speculative_config(text: str) -> dict | None:
    """--speculative-config's JSON object (None when empty); ValueError if it is not one."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return value


def worker_engine_core(args: argparse.Namespace) -> str:
    """A decode or prefill worker's --engine-core with auto resolved: process where the engine
    runs on a GPU without tensor parallelism (its step is host-bound there, and the worker's
    server, pushes and streams would share its interpreter lock), else thread."""
    choice = getattr(args, "engine_core", "thread")
    if choice != "auto":
        return choice
    from engine.model_runner import resolve_device

    on_gpu = resolve_device(args.device).type == "cuda"
    return "process" if on_gpu and args.tensor_parallel_size == 1 else "thread"


def serial_host_threads(args: argparse.Namespace) -> None:
    """On the CPU: the calling thread (a server's event loop) and its loop's `to_thread`
    executor run torch ops without an OpenMP team, so that the engine thread's is the process's
    only one (engine/omp_threads.py: with two, CPU decode steps ran ~3x slower)."""
    from engine.model_runner import resolve_device
    from engine.omp_threads import serial_executor, serial_thread

    if resolve_device(args.device).type != "cpu":
        return
    serial_thread()
    asyncio.get_running_loop().set_default_executor(serial_executor())


def build_engine(args: argparse.Namespace, role: str) -> AsyncLLMEngine:
    """The serving engine of `role` from the engine flags; with `--engine-core process` (the
    colocated server's, a decode or prefill worker's) its step loop runs in a process of its
    own (engine/core_client.py, decode_svc/core_client.py, prefill_svc/core_client.py)."""
    from engine.async_engine import AsyncLLMEngine

    engine_class: Any = AsyncLLMEngine
    extra: dict[str, Any] = {}
    if getattr(args, "engine_core_listen", "") and args.engine_core != "process":
        # else the servers joining it would wait for a socket nobody opens
        raise ValueError("--engine-core-listen: only with --engine-core process (is "
                         "PDSERVE_ENGINE_CORE=thread set?)")
    if role == "decode" and worker_engine_core(args) == "process":
        from decode_svc.core_client import DecodeCoreClient

        engine_class, extra = DecodeCoreClient, {"options": {"kv_transport": args.kv_transport}}
    elif role == "prefill" and worker_engine_core(args) == "process":
        from prefill_svc.core_client import PrefillCoreClient

        engine_class = PrefillCoreClient
    elif getattr(args, "engine_core", "thread") == "process" or getattr(
            args, "engine_core_address", ""):
        from engine.core_client import EngineCoreClient

        if args.engine_core_address:
            return EngineCoreClient.connect(args.engine_core_address)
        engine_class, extra = EngineCoreClient, {"listen": args.engine_core_listen}
    return engine_class.from_args(
        args.model, role=role, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        distributed_timeout_s=args.distributed_timeout_seconds,
        enforce_eager=args.enforce_eager,
        speculative_config=speculative_config(args.speculative_config),
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        stream_interval=args.stream_interval, **lora_engine_kwargs(args),
        **_pace_kwargs(args, role), **extra,
    )


def _pace_kwargs(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """A decode worker's --shared-gpu-pace-* flags and a prefill or decode worker's
    --shared-gpu-step-marks as engine arguments (none elsewhere)."""
    if role not in ("prefill", "decode"):
        return {}
    marks = {"shared_gpu_step_marks": args.shared_gpu_step_marks or None}
    if role == "prefill":
        return marks
    return {"shared_gpu_pace_ms": args.shared_gpu_pace_ms,
            "shared_gpu_pace_tokens": args.shared_gpu_pace_tokens, **marks}


def kv_transport_for(args: argparse.Namespace) -> str:
    """The KV data plane a worker offers: its --kv-transport, or grpc with tensor parallelism
    (the data planes map one pool per worker; a TP worker moves every rank's heads through
    rank 0, engine/distributed/kv_shards.py)."""
    if args.tensor_parallel_size > 1 and args.kv_transport != "grpc":
        logger.warning("--kv-transport %s with tensor parallelism: using grpc", args.kv_transport)
        return "grpc"
    return args.kv_transport


def advertise_address(args: argparse.Namespace) -> str:
    if args.advertise_address:
        return args.advertise_address
    host = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
    return f"{host}:{args.port}"


@dataclass
class TransferStats:
    """A worker's KV transfer counters: pushes sent (prefill) or received (decode). A push
    streams while the prefill worker computes (prefill_svc/sender.py): `seconds` run from the
    stream's start, so they hold compute time too; the overlap counters say how much of it
    moved early."""

    bytes: int = 0
    completed: int = 0
    failed: int = 0  # rejected (wrong bytes) or, on the sender, not accepted
    cut: int = 0  # decode: pushes that ended before their commit (the sender stopped or died)
    seconds: float = 0.0  # summed over completed transfers
    lease_expired: int = 0  # prefill: held KV freed unclaimed when its lease ran out
    # prefill: KV bytes sent before the first token was sampled, and the seconds from the first
    # token to the commit sent (what the second token waits for); completed pushes
    bytes_before_first_token: int = 0
    first_token_to_commit_seconds: float = 0.0
    # decode: seconds from a push's first slab to its commit (spans the prefill's compute when
    # the push overlapped it); completed pushes
    first_slab_to_commit_seconds: float = 0.0
    # completed transfers and their bytes per data plane ("grpc", "cuda_ipc", "nixl")
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    completed_by_transport: dict[str, int] = field(default_factory=dict)
    stale_pools: int = 0  # prefill: data-plane pushes refused as stale (the peer restarted)
    granted: int = 0  # prefill: data-plane pushes into blocks granted on Generate (no KVTarget)
    # prefill: seconds inside data-plane writes, each from its call to its bytes being in the
    # peer's memory (on CUDA a write first waits for the layers computing its blocks): the data
    # plane's share of a push; the rest is the gRPC control plane
    write_seconds: float = 0.0
    # blocks of completed pushes not moved: the decode worker's prefix cache held them
    skipped_blocks: int = 0
    # decode: requests committed by their push's doorbell (pdserve/transport/doorbell.py)
    # before the commit chunk came
    doorbell_commits: int = 0
    # data-plane pushes completed over a shared PushKVStreams call rather than a PushKV stream
    # of their own (prefill: sent, decode: received)
    shared_stream: int = 0
    # prefill: data-plane writes made; one carries the slabs of every push towards a decode
    # worker that asked for a write in the same event-loop turn (prefill_svc/write_batches.py)
    plane_writes: int = 0

    def record(self, num_bytes: int, seconds: float, transport: str = "grpc") -> None:
        self.bytes += num_bytes
        self.completed += 1
        self.seconds += seconds
        by = self.bytes_by_transport
        by[transport] = by.get(transport, 0) + num_bytes
        done = self.completed_by_transport
        done[transport] = done.get(transport, 0) + 1

    def record_overlap(self, bytes_early: int, first_token_to_commit_s: float) -> None:
        self.bytes_before_first_token += bytes_early
        self.first_token_to_commit_seconds += first_token_to_commit_s

    def counters(self) -> dict[str, float]:
        """The Prometheus counters (vLLM-style names under `pdserve:`)."""
        return {
            "kv_transfer_failures": self.failed,
            "kv_transfers_cut": self.cut,
            "kv_transfer_seconds": self.seconds,
            "kv_lease_expired": self.lease_expired,
            "kv_transfer_bytes_before_first_token": self.bytes_before_first_token,
            "kv_transfer_first_token_to_commit_seconds": self.first_token_to_commit_seconds,
            "kv_transfer_first_slab_to_commit_seconds": self.first_slab_to_commit_seconds,
            "kv_transfer_stale_pools": self.stale_pools,
            "kv_transfer_granted_pushes": self.granted,
            "kv_transfer_write_seconds": self.write_seconds,
            "kv_transfer_skipped_blocks": self.skipped_blocks,
            "kv_transfer_doorbell_commits": self.doorbell_commits,
            "kv_transfer_shared_stream_pushes": self.shared_stream,
            "kv_transfer_plane_writes": self.plane_writes,
        }

    def by_transport(self) -> dict[str, dict[str, float]]:
        """Counters labelled by data plane (the totals are their sums); grpc always present."""
        return {
            "kv_transfer_bytes": {"grpc": 0, **self.bytes_by_transport},
            "kv_transfers": {"grpc": 0, **self.completed_by_transport},
        }


@dataclass
class WorkerMonitor:
    """The latest engine stats plus transfer counters, for the heartbeat and /metrics."""

    role: str
    address: str
    engine: AsyncLLMEngine
    counters: Callable[[], dict[str, float]] = field(default=lambda: {})
    by_transport: Callable[[], dict[str, dict[str, float]]] = field(default=lambda: {})
    metrics_address: str = ""
    kv_transport: str = ""  # its --kv-transport, published in the registry
    tensor_parallel_size: int = 0  # its --tensor-parallel-size, published in the registry
    block_size: int = 0  # its --block-size, published in the registry (prefix hashes' unit)
    # The prefix cache's events since the last call (engine/kv_events.py), published into
    # Redis after each heartbeat for KV-aware routing; None: nothing to publish
    prefix_events: Callable[[bool], Awaitable[KVEventBatch]] | None = None
    stats: SchedulerStats | None = None
    max_loras: int = 0  # --max-loras (0: LoRA off), the lora_requests_info metric's label
    # The names of the LoRA adapters the engine holds, published in the registry
    loras: Callable[[], list[str]] = field(default=lambda: [])

    async def info(self) -> WorkerInfo:
        self.stats = s = await self.engine.stats()
        return WorkerInfo(
            worker_id=f"{self.role}-{self.address}", role=self.role, address=self.address,
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            metrics_address=self.metrics_address, kv_transport=self.kv_transport,
            tensor_parallel_size=self.tensor_parallel_size,
            block_size=self.block_size, num_cached_blocks=s.num_cached_blocks,
            lora_adapters=self.loras(), features=list(FEATURES.get(self.role, [])),
        )


class _StatsCollector(Collector):
    """Renders a WorkerMonitor's latest snapshot with vLLM's metric names; with `max_loras`
    (--enable-lora's --max-loras), vLLM's lora_requests_info too."""

    def __init__(self, monitor: WorkerMonitor, max_loras: int = 0):
        self.monitor = monitor
        self.max_loras = max_loras

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s, role = self.monitor.stats, self.monitor.role
        if s is not None:
            for name, value in (
                ("num_requests_running", s.num_running),
                ("num_requests_waiting", s.num_waiting),  # those waiting for KV blocks too
                ("num_requests_waiting_for_kv_blocks", s.num_waiting_for_blocks),
                ("kv_cache_usage_perc", s.kv_cache_usage),
                ("kv_cache_free_blocks", s.num_free_blocks),
                ("kv_cache_total_blocks", s.num_total_blocks),
            ):
                yield _gauge(f"pdserve:{name}", value, role)
            for name, value in (
                ("num_preemptions", s.num_preemptions),
                ("prefix_cache_queries", s.prefix_cache_queries),
                ("prefix_cache_hits", s.prefix_cache_hits),
                ("grammar_compiles", s.grammar_compiles),  # structured outputs
                ("grammar_compile_cache_hits", s.grammar_cache_hits),
                ("grammar_compile_seconds", s.grammar_compile_seconds),
                ("grammar_bitmask_seconds", s.grammar_bitmask_seconds),
                ("spec_decode_num_drafts", s.spec_decode_num_drafts),  # speculative decoding
                ("spec_decode_num_draft_tokens", s.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", s.spec_decode_num_accepted_tokens),
            ):
                yield _counter(f"pdserve:{name}", value, role)
            if self.max_loras:
                yield lora_requests_info(s, self.max_loras, role)
            per_pos = CounterMetricFamily(
                "pdserve:spec_decode_num_accepted_tokens_per_pos",
                "accepted draft tokens by position", labels=["role", "position"])
            for position, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([role, str(position)], value)
            yield per_pos
        for name, value in self.monitor.counters().items():
            yield _counter(f"pdserve:{name}", value, role)
        for name, values in self.monitor.by_transport().items():
            c = CounterMetricFamily(f"pdserve:{name}", name.replace("_", " "),
                                    labels=["role", "transport"])
            for transport, value in values.items():
                c.add_metric([role, transport], value)
            yield c


def _gauge(name: str, value: float, role: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, name.split(":", 1)[1].replace("_", " "), labels=["role"])
    g.add_metric([role], value)
    return g


def _counter(name: str, value: float, role: str) -> CounterMetricFamily:
    c = CounterMetricFamily(name, name.split(":", 1)[1].replace("_", " "), labels=["role"])
    c.add_metric([role], value)
    return c


def watch_cancellations(
    args: argparse.Namespace, on_cancel: Callable[[str], Awaitable[object]]
) -> CancelWatch | NoCancelWatch:
    """Abort requests cancelled through Redis (with --redis-url); needs a running loop."""
    if not args.redis_url:
        return NoCancelWatch()
    watch = CancelWatch(args.redis_url, on_cancel, args.redis_namespace)
    watch.start()
    return watch


async def run_worker(
    args: argparse.Namespace, role: str, engine: AsyncLLMEngine,
    add_servicer: Callable[[grpc.aio.Server], None], transfer: TransferStats,
    on_stop: Callable[[], Awaitable[None]], busy: Callable[[], bool] = lambda: False,
    gate: DrainGate | None = None,
) -> None:
    """Serve a worker's gRPC service until SIGTERM: health NOT_SERVING until it listens, then
    metrics and registry heartbeat; on SIGTERM the graceful stop of `pdserve.cluster.drain`
    (`busy`: work in flight that no call accounts for; `gate`: the drain gate, when the
    servicer must see it too), then engine shutdown."""
    await preload_loras(engine, args)
    service = f"pdserve.v1.{role.capitalize()}"
    gate = gate or DrainGate()
    server, health = await make_server(service, add_servicer, [gate])
    listen(server, f"{args.host}:{args.port}", tls_from_args(args))
    await server.start()
    monitor = WorkerMonitor(role, advertise_address(args), engine, transfer.counters,
                            transfer.by_transport,
                            kv_transport=getattr(args, "kv_transport", ""),
                            tensor_parallel_size=args.tensor_parallel_size,
                            block_size=args.block_size,
                            prefix_events=engine.prefix_events,
                            max_loras=args.max_loras if args.enable_lora else 0,
                            loras=lambda: [r.lora_name for r in engine.list_loras()])
    heartbeat = await start_monitoring(args, monitor)
    stats_log = start_stats_log(args, engine.stats)
    serving_process_ready(f"{role}-server")
    await set_serving(health, service)
    logger.info("%s worker serving on %s", role, monitor.address)

    async def deregister() -> None:
        await set_serving(health, service, serving=False)
        if heartbeat is not None:
            await heartbeat.stop()

    stopped = asyncio.create_task(wait_for_signal())
    died = asyncio.create_task(_engine_failure(engine))
    await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
    if died.done():
        # A tensor-parallel rank died or hung (the engine failed its requests already): leave
        # the registry and exit non-zero for the launcher or Kubernetes to restart the worker.
        logger.error("the engine failed (%s): leaving the registry, exiting", died.result())
        await deregister()
        await on_stop()
        await server.stop(1.0)
        engine.shutdown()
        raise SystemExit(1)
    died.cancel()
    if stats_log is not None:
        stats_log.cancel()
    logger.info("stopping: draining for up to %.0f s", args.drain_timeout)
    await drain(gate, server, args.drain_timeout, deregister, on_stop, busy)
    engine.shutdown()


async def _engine_failure(engine: AsyncLLMEngine, every_s: float = 0.5) -> BaseException:
    """Return the engine loop's error once it has failed."""
    while engine.failure is None:
        await asyncio.sleep(every_s)
    return engine.failure


class PrefixPublisher:
    """After each heartbeat: the prefix cache's events since the last one, into Redis
    (pdserve/cluster/prefix_index.py). A batch that fails to publish is lost, so the next one
    publishes the whole set instead; so does one published after the set may have expired (the
    index's TTL passed since the last publish: the engine, asked between steps, answered late),
    since events applied to a lapsed set would leave out every block cached before."""

    def __init__(self, index: PrefixIndex, events: Callable[[bool], Awaitable[KVEventBatch]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index, self.events, self.clock = index, events, clock
        self._resync = False
        self._published_at: float | None = None  # clock() when the last publish was sent

    async def __call__(self, info: WorkerInfo) -> None:
        batch = await self.events(self._resync)
        if not batch.reset and self._lapsed():
            batch = await self.events(True)
        self._resync = True
        sent_at = self.clock()
        await self.index.publish(info.worker_id, batch)
        self._resync, self._published_at = False, sent_at

    def _lapsed(self) -> bool:
        """Whether the set may have expired: a margin of a tenth of the TTL for Redis's clock."""
        return (self._published_at is not None
                and self.clock() - self._published_at > 0.9 * self.index.ttl_s)


async def start_monitoring(args: argparse.Namespace, monitor: WorkerMonitor) -> Heartbeat | None:
    """Serve /metrics (when --metrics-port) and heartbeat into the registry (when --redis-url)."""
    if args.metrics_port:
        registry = CollectorRegistry()
        registry.register(_StatsCollector(monitor, monitor.max_loras))
        start_http_server(args.metrics_port, addr=args.host, registry=registry)
        monitor.metrics_address = f"{advertise_address(args).rsplit(':', 1)[0]}:{args.metrics_port}"
    await monitor.info()
    if not args.redis_url:
        return None
    registry = WorkerRegistry(connect(args.redis_url), prefix=args.redis_namespace)
    publish = None
    if monitor.prefix_events is not None:
        index = PrefixIndex(registry.client, prefix=args.redis_namespace, ttl_s=registry.ttl_s)
        publish = PrefixPublisher(index, monitor.prefix_events)
    heartbeat = Heartbeat(registry, monitor.info, after_beat=publish)
    heartbeat.start()
    return heartbeat
