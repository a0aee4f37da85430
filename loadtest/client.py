"""The streaming client: OpenAI `/v1/completions` or `/v1/chat/completions` over one httpx
connection pool, filling in each request's timeline (loadtest/record.py).

Every request is streamed with `stream_options.include_usage`, so the last chunk carries the
server's token counts; `ignore_eos` (vLLM's extension, which pdserve takes too) holds the output
at exactly max_tokens. A chunk counts as output when it carries text (completions `text`, chat
`delta.content`); with --logprobs the server also says how many tokens each chunk holds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.record import RequestRecord
from loadtest.workloads import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# An idle pooled connection is reused only this long. A server closes an idle connection after
# its own keep-alive (uvicorn, vLLM's server among them: 5 s); a request sent on a connection
# the server is closing at that moment fails with a reset (httpx.ReadError) although the server
# was never at fault. Staying well under the common 5 s keeps the load test clear of that race.
KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class ClientConfig:
    # http://host:port (a trailing /v1 is dropped); several, comma-separated, are sent requests
    # in turn (replicas without a load balancer in front)
    base_url: str
    endpoint: str = "completions"
    model: str = ""  # "" asks the server (/v1/models, the first)
    prompt_format: str = "ids"  # completions: token ids where the workload has them, or text
    ignore_eos: bool = True
    temperature: float = 0.0
    logprobs: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str = ""
    timeout_s: float = 600.0  # per request

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt format must be ids or text, got {self.prompt_format!r}")

    @property
    def roots(self) -> list[str]:
        return [u.strip().rstrip("/").removesuffix("/v1") for u in self.base_url.split(",")
                if u.strip()]


class StreamClient:
    """One pool of connections (`max_connections`: None for as many as requests in flight)."""

    def __init__(self, cfg: ClientConfig, max_connections: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections,
                              keepalive_expiry=KEEPALIVE_S)
        timeout = httpx.Timeout(cfg.timeout_s, pool=None)
        self.cfg, self.model = cfg, cfg.model
        self.roots, self._sent = cfg.roots, 0
        if not self.roots:
            raise ValueError("base_url names no server")
        self.http = httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout,
                                      transport=transport)

    async def __aenter__(self) -> StreamClient:
        if not self.model:
            r = await self.http.get(f"{self.roots[0]}/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        """The request body for `spec`."""
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": self.model, "stream": True, "stream_options": {"include_usage": True},
            "temperature": cfg.temperature,
        }
        if cfg.endpoint == "chat":
            body |= {"messages": spec.messages, "max_completion_tokens": spec.output_len}
            if cfg.logprobs:
                body |= {"logprobs": True, "top_logprobs": 0}
        else:
            ids = cfg.prompt_format == "ids" and spec.token_ids is not None
            body |= {"prompt": spec.token_ids if ids else spec.text, "max_tokens": spec.output_len}
            if cfg.logprobs:
                body["logprobs"] = 0
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        return body | cfg.extra_body

    async def send(self, spec: RequestSpec, record: RequestRecord,
                   clock: Callable[[], float]) -> None:
        """Stream `spec`, filling `record` (times from `clock`). Never raises for a failed
        request: it is recorded in `record.error`. A cancelled one is recorded, then re-raised."""
        record.sent_at = clock()
        root = self.roots[self._sent % len(self.roots)]
        self._sent += 1
        try:
            async with self.http.stream("POST", root + ENDPOINTS[self.cfg.endpoint],
                                        json=self.payload(spec)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {body[:300]}"
                    return
                await self._read(response, record, clock)
        except asyncio.CancelledError:
            record.error = "cancelled: the run's --max-duration was reached"
            raise
        except (httpx.HTTPError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.done_at = clock()

    async def _read(self, response: httpx.Response, record: RequestRecord,
                    clock: Callable[[], float]) -> None:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now, event = clock(), json.loads(data)
            if "error" in event:
                record.error = f"stream error: {event['error'].get('message', event['error'])}"
                return
            record.request_id = event.get("id", record.request_id)
            _add_chunk(event, record, now)
            if usage := event.get("usage"):
                record.prompt_tokens = usage.get("prompt_tokens")
                record.completion_tokens = usage.get("completion_tokens")
        if not record.chunk_at:
            record.error = "the stream ended with no output"


def _add_chunk(event: dict[str, Any], record: RequestRecord, now: float) -> None:
    """Record one SSE event's arrival if it carries output (text, or tokens by logprobs)."""
    text, tokens = "", 0
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
        logprobs = choice.get("logprobs") or {}
        tokens += len(logprobs.get("tokens") or logprobs.get("content") or [])
    if text or tokens:
        record.chunk_at.append(now)
        if tokens:
            record.chunk_tokens.append(tokens)
