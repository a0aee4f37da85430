"""Prometheus metrics of the gateway, named as vLLM's (`vllm:` becomes `pdserve:`).

Each app owns its `CollectorRegistry`, so several apps can live in one process (tests).
Latencies are seen from the gateway: time to first token counts from the request's arrival.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.scheduler_output import SchedulerStats
from pdserve.cluster.lora_metrics import lora_requests_info

_LABELS = ["model_name"]
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
_ITL_BUCKETS = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
_E2E_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_requests_running = Gauge(
            "pdserve:num_requests_running", "Requests in flight at the gateway.", _LABELS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds", "Time from arrival to the first token.",
            _LABELS, buckets=_TTFT_BUCKETS, registry=r,
        )
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds", "Time between output tokens of a sequence.",
            _LABELS, buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds", "Time from arrival to the last token.",
            _LABELS, buckets=_E2E_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens of admitted requests.", _LABELS, registry=r
        )
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Generated tokens.", _LABELS, registry=r
        )
        self.request_success = Counter(
            "pdserve:request_success", "Finished sequences, by finish reason.",
            [*_LABELS, "finished_reason"], registry=r,
        )
        self.requests_rejected = Counter(
            "pdserve:requests_rejected", "Requests answered 429: too many in flight.",
            registry=r,
        )
        self.decode_migrations = Counter(
            "pdserve:decode_migrations", "Streams moved to another decode worker after theirs "
            "failed (re-prefilled with the tokens already generated).", registry=r,
        )
        self.prefill_retries = Counter(
            "pdserve:prefill_retries", "Prefills retried on another prefill worker after "
            "theirs failed.", registry=r,
        )
        self.stream_reconnects = Counter(
            "pdserve:stream_reconnects", "Resume requests (GET /v1/streams/{id}) answered.",
            registry=r,
        )
        self.routing_decisions = Counter(
            "pdserve:routing_decisions", "Workers picked, by role and reason: prefix_hit (its "
            "cached prefix won), lora_hit (it held the request's LoRA adapter), load, "
            "round_robin (pdserve/cluster/routing.py), only (one worker of each role could "
            "take the request).",
            ["role", "reason"], registry=r,
        )
        self.stream_resumes = Counter(
            "pdserve:stream_resumes", "Broken streams whose generation this gateway took over "
            "(their sequences re-prefilled with the tokens already sent).", registry=r,
        )

        self._refreshers: list[Callable[[], Awaitable[None]]] = []

    def watch_engine(self, stats: Callable[[], Awaitable[SchedulerStats]], max_loras: int
                     ) -> None:
        """Render an in-process engine's vLLM `lora_requests_info` (the colocated `pdserve
        serve` with --enable-lora), from `stats` read before each render."""
        collector = _EngineLoRACollector(stats, max_loras)
        self.registry.register(collector)
        self._refreshers.append(collector.refresh)

    async def refresh(self) -> None:
        """Read what the collectors render (call before `render`)."""
        for refresh in self._refreshers:
            await refresh()

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)


class _EngineLoRACollector(Collector):
    def __init__(self, stats: Callable[[], Awaitable[SchedulerStats]], max_loras: int) -> None:
        self.stats, self.max_loras = stats, max_loras
        self.latest: SchedulerStats | None = None

    async def refresh(self) -> None:
        self.latest = await self.stats()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.latest is not None:
            yield lora_requests_info(self.latest, self.max_loras)
