"""`GET /v1/streams/{request_id}`: a streamed response again, after the last event the client
got (`Last-Event-ID`), through any gateway of the cluster.

NOTE: how a resume goes on, once it has sent what the log holds after that event.

    tail       a gateway holds the stream's lease (it is generating it): send its events as
               they are logged, until [DONE]
    take over  nobody holds it (its gateway died, or its client left, which aborted the
               generation everywhere): take the lease; render the logged outputs again through
               a fresh view, dropping the events they made; generate each unfinished choice on
               from its logged tokens (re-prefilled: `prior_token_ids`); log and send the rest
    done       the log ends with [DONE]
A tail that finds the lease gone without [DONE] (its owner died too) takes over. A client that
leaves a taken-over stream aborts its generation, as on the first gateway; the next resume
takes over again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from fastapi import Response

from engine.lora import LoRARequest
from gateway import chat, completions
from gateway.backend import resumed_request_id
from gateway.errors import OpenAIError
from gateway.protocol import ErrorResponse
from gateway.recorder import (
    StreamRecord,
    StreamRecorder,
    StreamView,
    decode_outputs,
    new_owner,
    sse_event,
)
from gateway.sequence import SequenceOutput, SequenceSpec
from gateway.serving import (
    SSE_DONE,
    ServingContext,
    fan_out,
    generate_outputs,
    sse_stream,
    stream_response,
)
from pdserve.cluster.event_log import EventLog, LogEvent
from pdserve.cluster.state import StateStoreError

T = TypeVar("T")
TAIL_BLOCK_MS = 1000  # a tail checks for its owner this often (under Redis' socket timeout)
VIEWS: dict[str, Callable[[StreamRecord, Any], StreamView]] = {
    completions.KIND: completions.restore_view, chat.KIND: chat.restore_view,
}


class StreamResumer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def resume(self, request_id: str, after: int) -> Response:
        """The stream of `request_id` from the event after `after` (-1: from the start).
        Raises OpenAIError: 404 for a stream unknown or expired, or when this gateway records
        none (no Redis: `resume_not_supported`); 503 when Redis fails."""
        log = self.ctx.events
        if log is None:
            raise OpenAIError("This gateway records no streams (it runs without Redis, as "
                              "`pdserve serve` does, or with --resume-ttl-seconds 0): none "
                              "can be resumed.", status=404, code="resume_not_supported")
        self.ctx.metrics.stream_reconnects.inc()
        try:
            meta = await log.meta(request_id)
        except StateStoreError as exc:
            raise _unavailable(exc) from exc
        if meta is None:
            raise OpenAIError(f"No stream `{request_id}` to resume: unknown, not streamed, or "
                              "expired.", status=404, param="request_id", code="stream_not_found")
        return stream_response(request_id, self._follow(log, request_id, after))

    async def _follow(self, log: EventLog, request_id: str,
                      after: int) -> AsyncGenerator[str, None]:
        """The log's events after `after` as they come; taking over when nobody generates.
        Redis failing ends the stream with an error event and no [DONE] (resume later)."""
        cursor = after
        block_ms: int | None = None  # the first read does not wait
        try:
            while True:
                events = await log.read(request_id, cursor, block_ms=block_ms)
                if not events:  # caught up, and the owner quiet for block_ms: is there one?
                    owner = new_owner()
                    if await log.acquire(request_id, owner):
                        rest = self._take_over(log, request_id, owner, cursor, after)
                        async with contextlib.aclosing(rest):
                            async for text in rest:
                                yield text
                        return
                    block_ms = TAIL_BLOCK_MS
                for event in events:
                    yield sse_event(event.id, event.data)
                    cursor = event.id
                    if event.data == SSE_DONE:
                        return
        except StateStoreError as exc:
            yield f"data: {ErrorResponse(error=_unavailable(exc).info()).model_dump_json()}\n\n"

    async def _take_over(self, log: EventLog, request_id: str, owner: str, cursor: int,
                         after: int) -> AsyncGenerator[str, None]:
        """Generate the rest of a stream whose lease `owner` now holds: first the logged events
        after `cursor`, then new ones (those up to `after` are logged, not sent)."""
        recorder = None
        try:
            meta = await log.meta(request_id)
            logged = await log.read(request_id)
            for event in logged:
                if event.id > cursor:
                    yield sse_event(event.id, event.data)
            if meta is None or meta.done:
                return
            recorder = StreamRecorder(log, request_id, owner=owner, next_id=len(logged))
            record = StreamRecord.from_json(meta.spec)
            _, lora = await self.ctx.resolve_model(record.model)  # its LoRA adapter, if any
            events = self._continue(record, logged, recorder, lora)
            async with contextlib.aclosing(recorder.record(events, after)) as rest:
                async for text in rest:
                    yield text
        finally:
            if recorder is None or not recorder.started:
                await log.release(request_id, owner)

    def _continue(self, record: StreamRecord, logged: list[LogEvent],
                  recorder: StreamRecorder, lora: LoRARequest | None = None,
                  ) -> AsyncGenerator[str, None]:
        """The stream's SSE events after the `logged` ones: the view renders the logged outputs
        (its events dropped), then those of the unfinished choices, generated on."""
        tokenizer = self.ctx.backend.get_tokenizer()
        view = VIEWS[record.kind](record, tokenizer)
        replayed = [out for event in logged for out in decode_outputs(event.out)]
        specs = fan_out(record.request_id, record.prompts, record.sampling_params(), lora)
        tracker = self.ctx.tracker(record.request_id, record.model, time.monotonic(),
                                   sum(len(p) for p in record.prompts), len(specs), True)
        tracker.resume_after(replayed)
        self.ctx.metrics.stream_resumes.inc()
        new = generate_outputs(self.ctx, tracker, _unfinished(specs, replayed),
                               may_join=recorder.may_join)
        outputs = _chain(replayed, recorder.tap(new))
        return sse_stream(record.request_id, _drop(view.chunks(outputs), len(logged)))


def _unfinished(specs: list[SequenceSpec], replayed: list[SequenceOutput]) -> list[SequenceSpec]:
    """The sequences to generate on, each after its logged tokens, under a fresh backend id."""
    prior: dict[int, list[int]] = {}
    finished = set()
    for out in replayed:
        prior.setdefault(out.index, []).extend(out.token_ids)
        if out.finished:
            finished.add(out.index)
    tag = secrets.token_hex(4)
    return [dataclasses.replace(s, request_id=resumed_request_id(s.request_id, tag),
                                prior_token_ids=prior.get(s.index, []))
            for s in specs if s.index not in finished]


async def _chain(first: list[T], rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    async with contextlib.aclosing(rest):
        for item in first:
            yield item
        async for item in rest:
            yield item


async def _drop(items: AsyncGenerator[T, None], count: int) -> AsyncGenerator[T, None]:
    """`items` but the first `count`."""
    async with contextlib.aclosing(items):
        async for item in items:
            if count > 0:
                count -= 1
                continue
            yield item


def _unavailable(exc: StateStoreError) -> OpenAIError:
    return OpenAIError(f"The stream's log is unreachable: {exc}. Please retry.", status=503,
                       code="service_unavailable")
