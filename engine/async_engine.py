"""`AsyncLLMEngine`: many concurrent callers, one running batch.

NOTE: the engine's steps run on one background thread that owns the `LLMEngine`; the asyncio side
only adds and aborts requests (under a lock, between steps) and reads per-request queues that the
thread fills with `loop.call_soon_threadsafe`. A step never blocks the event loop, so a request
arriving while others decode joins the batch at the next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine, PromptInput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerStats

_ABORTED = object()  # ends a stream whose request was aborted through `abort()`


class EngineDeadError(RuntimeError):
    """The engine's step loop raised; no request can make progress."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> AsyncLLMEngine:
        """Build from the same arguments as `LLM`."""
        return cls(LLMEngine(build_engine_config(model, **kwargs)))

    async def generate(
        self, prompt: PromptInput, sampling_params: SamplingParams | None, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one prompt until it finishes.

        Each output is cumulative, or holds only what is new with
        `SamplingParams(output_kind="delta")`, or comes once at the end with "final_only".
        Leaving the loop early (break, cancellation, a dropped client) aborts the request and
        frees its blocks. Bad input raises ValueError before anything is queued.
        """
        if self._error is not None:
            raise EngineDeadError("the engine loop has failed") from self._error
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            await asyncio.to_thread(self._add, request_id, prompt, sampling_params)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop has failed") from item
                finished = item.finished
                yield item
        finally:
            stream = self._streams.pop(request_id, None)
            if not finished and stream is not None:
                await asyncio.to_thread(self._abort, request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; its stream ends without a final output."""
        await asyncio.to_thread(self._abort, request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, _ABORTED)

    async def stats(self) -> SchedulerStats:
        return await asyncio.to_thread(self._stats)

    def shutdown(self) -> None:
        """Stop the step loop thread (requests in flight are abandoned)."""
        self._stopping = True
        self._work.set()
        self._thread.join(timeout=30)

    # ---- thread side ---------------------------------------------------------------------
    def _add(self, request_id: str, prompt: PromptInput, params: SamplingParams | None) -> None:
        with self._lock:
            self.engine.add_request(request_id, prompt, params)
        self._work.set()

    def _abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)

    def _stats(self) -> SchedulerStats:
        with self._lock:
            return self.engine.stats()

    def _loop(self) -> None:
        while not self._stopping:
            self._work.wait()
            try:
                with self._lock:
                    if not self.engine.has_work():
                        self._work.clear()
                        continue
                    outputs = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
                self._error = exc
                self._fail_all(exc)
                return
            for out in outputs:
                self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, exc)
