"""One request's accounting at the gateway: its metrics, and its record in the state store
(Redis in the cluster) from admission (`queued`) to its end (finished, failed or cancelled).
The states in between (prefilling, transferring, decoding) are the backend's to record. A
resumed stream's request goes back to `queued` (`RequestStore.resume`) and on to its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType
from typing import Any, Protocol

import anyio

from gateway.backend import BackendError
from gateway.metrics import GatewayMetrics
from gateway.sequence import SequenceOutput

logger = logging.getLogger("pdserve.gateway")
STORE_TIMEOUT_S = 5.0


class StateStore(Protocol):
    """Request state records (Redis in the cluster): `pdserve.cluster.state.RequestStore`."""

    async def create(
        self, request_id: str, *, model: str, prompt_tokens: int, stream: bool, n: int = 1
    ) -> Any: ...

    async def transition(self, request_id: str, status: str, **fields: Any) -> Any: ...

    async def resume(self, request_id: str) -> Any: ...


class RequestTracker:
    """One request's accounting from admission to its end: the gateway's metrics and, when a
    store is given, its state record (created `queued`; finished, failed or cancelled)."""

    def __init__(
        self, metrics: GatewayMetrics, store: StateStore | None, request_id: str, model: str,
        arrival: float, prompt_tokens: int, num_choices: int, stream: bool,
    ) -> None:
        self.metrics, self.store = metrics, store
        self.request_id, self.model, self.arrival = request_id, model, arrival
        self.prompt_tokens, self.num_choices, self.stream = prompt_tokens, num_choices, stream
        self.output_tokens = 0
        self.finish_reasons: dict[int, str] = {}
        self._first_token: float | None = None
        self._creating: asyncio.Future[None] | None = None  # the record's create, written
        self._last_token: dict[int, float] = {}
        self.resumed = False
        # the per-token series, looked up once (a labels() call costs a lock and a dict lookup)
        self._inter_token = metrics.inter_token_latency.labels(model)
        self._generation_tokens = metrics.generation_tokens.labels(model)

    def resume_after(self, outputs: list[SequenceOutput]) -> None:
        """Make this the tracker of a resumed stream, whose `outputs` were generated before (by
        another gateway, maybe): they count as this request's, not again in the metrics, and
        its record is resumed rather than created. Call before entering."""
        self.resumed = True
        self._first_token = self.arrival  # the first token came long ago: no TTFT
        for out in outputs:
            self.output_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                self.finish_reasons[out.index] = out.finish_reason

    async def __aenter__(self) -> RequestTracker:
        m = self.metrics
        m.num_requests_running.labels(self.model).inc()
        try:
            if self.resumed:
                await self._record("resume", self.request_id)
            else:  # not waited for: the store orders the request's later writes after it
                # (each write is a task, and tasks start in order: the create registers first)
                m.prompt_tokens.labels(self.model).inc(self.prompt_tokens)
                self._creating = self._start(
                    "create", self.request_id, model=self.model,
                    prompt_tokens=self.prompt_tokens, stream=self.stream, n=self.num_choices,
                )
        except BaseException as exc:  # cancelled meanwhile (client gone): `async with` will
            await self.__aexit__(type(exc), exc, exc.__traceback__)  # not call __aexit__
            raise
        return self

    def observe(self, out: SequenceOutput) -> None:
        """Count one sequence output: tokens, time to first token, inter-token latency."""
        m, now, count = self.metrics, time.monotonic(), len(out.token_ids)
        if count:
            if self._first_token is None:
                self._first_token = now
                m.time_to_first_token.labels(self.model).observe(now - self.arrival)
            last = self._last_token.get(out.index)
            if last is not None:
                for _ in range(count):
                    self._inter_token.observe((now - last) / count)
            self._last_token[out.index] = now
            self.output_tokens += count
            self._generation_tokens.inc(count)
        if out.finish_reason is not None:
            self.finish_reasons[out.index] = out.finish_reason
            m.request_success.labels(self.model, out.finish_reason).inc()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Record how the request ended: finished (every choice has a finish reason),
        cancelled (client gone) or failed (an error); never swallows the exception."""
        m, elapsed = self.metrics, time.monotonic() - self.arrival
        m.num_requests_running.labels(self.model).dec()
        fields: dict[str, Any] = {"output_tokens": self.output_tokens}
        if exc is None and len(self.finish_reasons) == self.num_choices:
            status = "finished"
            fields["finish_reason"] = self.finish_reasons[min(self.finish_reasons)]
            if not self.resumed:  # its arrival was before the resume
                m.e2e_request_latency.labels(self.model).observe(elapsed)
        elif exc is None or isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            status = "cancelled"
            for _ in range(self.num_choices - len(self.finish_reasons)):
                m.request_success.labels(self.model, "abort").inc()
        else:
            status, fields["error"] = "failed", str(exc) or type(exc).__name__
        self._log(status, elapsed, exc)
        await self._record("transition", self.request_id, status, **fields)
        if self._creating is not None:
            await asyncio.wait({self._creating})  # landed already, nothing left behind

    def _log(self, status: str, elapsed: float, exc: BaseException | None) -> None:
        summary = (f"{self.request_id}: {status} in {elapsed:.3f}s, "
                   f"prompt_tokens={self.prompt_tokens} output_tokens={self.output_tokens}")
        if status != "failed":
            logger.info(summary)
        elif isinstance(exc, BackendError):
            logger.error("%s: %s", summary, exc)
        else:  # a bug: keep the traceback (in the log, never in a response)
            logger.error(summary, exc_info=exc)

    async def _record(self, method: str, *args: Any, **fields: Any) -> None:
        """Write to the store, if any; a store failure is logged, never fails the request.

        The write runs in a task of its own, so that cancelling the request (its client went
        away) never cuts it in half: a cancelled caller waits for it to land (at most
        STORE_TIMEOUT_S), then the cancellation goes on. (An anyio shield would not do: the
        gateway cancels request tasks with `Task.cancel()`, which anyio scopes do not stop.)"""
        write = self._start(method, *args, **fields)
        if write is None:
            return
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.wait({write})
            raise

    def _start(self, method: str, *args: Any, **fields: Any) -> asyncio.Future[None] | None:
        """The store write as a task of its own (None without a store)."""
        if self.store is None:
            return None
        return asyncio.ensure_future(self._write(method, *args, **fields))

    async def _write(self, method: str, *args: Any, **fields: Any) -> None:
        assert self.store is not None
        try:
            with anyio.move_on_after(STORE_TIMEOUT_S) as scope:
                await getattr(self.store, method)(*args, **fields)
            if scope.cancelled_caught:
                logger.warning("%s: state store %s timed out", self.request_id, method)
        except Exception:  # noqa: BLE001 - the store is best effort
            logger.warning("%s: state store %s failed", self.request_id, method, exc_info=True)
