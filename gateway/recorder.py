"""Streams recorded as they go out, so that they can be resumed (gateway/resume.py).

NOTE: what is recorded, and when.

    outputs ──tap──▶ view.chunks ──▶ sse_stream ──record──▶ client  ("id: n" + event n)
               │                                    │
               └─ outputs consumed since the        └─ event n, with those outputs ──▶ the
                  previous event                       gateway's log writer ──▶ Redis

Every SSE event gets an id (0, 1, 2, ...) and goes into the log with the sequence outputs the
view consumed to render it (their token ids, text and finish), so that a resume can render the
same events again and knows each choice's tokens. The gateway's one log writer
(pdserve/cluster/log_writer.py) sends every stream's new events in one script call per round
trip and renews the leases of quiet streams; a stream never waits for it. [DONE] marks the log
done; a stream cut short (client gone, error) just gives its lease up, for a resume to take
over. A gateway that is killed loses the events of its last round trip at most: a resume
generates them again (the same events for greedy or seeded sampling).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from gateway.sequence import JoinGate, SequenceOutput
from gateway.serving import sse_stream
from pdserve.cluster.event_log import EventLog, LogEvent

logger = logging.getLogger("pdserve.gateway")
END_WAIT_S = 1.0  # how long a stream's end waits for its last events to be written


class StreamView(Protocol):
    """What renders a request's outputs as SSE chunks (completions.py, chat.py)."""

    created: int

    def chunks(self, events: AsyncGenerator[SequenceOutput, None]) -> AsyncGenerator[str, None]:
        ...


@dataclass(frozen=True)
class StreamRecord:
    """How to render a stream again and generate its sequences: what its view was built from
    and its sequences' input. Stored once, when the stream opens."""

    kind: str  # "completions" | "chat": which view
    request_id: str
    model: str
    created: int  # the chunks' timestamp
    body: dict[str, Any]  # the request as validated (JSON types)
    prompts: list[list[int]]  # token ids of each prompt
    prompt_texts: list[str | None]  # for echo (None: token-id prompts)
    params: list[dict[str, Any]]  # each prompt's SamplingParams fields (n included), as JSON:
    # output_kind its value, structured_outputs [kind, spec] (the wire's two strings) or None
    tool_parser: str | None = None  # chat with tool_choice "auto": the parser reading calls

    @classmethod
    def of(cls, kind: str, request_id: str, model: str, created: int, body: dict[str, Any],
           prompts: list[list[int]], texts: list[str | None],
           params: list[SamplingParams], tool_parser: str | None = None) -> StreamRecord:
        fields = [{f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}
                  for p in params]
        for f in fields:
            f["output_kind"] = f["output_kind"].value
            so = f["structured_outputs"]
            f["structured_outputs"] = None if so is None else [so.kind, so.spec()]
        return cls(kind, request_id, model, created, body, prompts, texts, fields, tool_parser)

    def sampling_params(self) -> list[SamplingParams]:
        """The params as recorded; a resume generates on under the same constraint."""
        return [SamplingParams(**{**p, "structured_outputs": _constraint(p)})
                for p in self.params]

    def to_json(self) -> str:  # its fields as they are (asdict would deep-copy the prompts)
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StreamRecord:
        return cls(**json.loads(text))


def _constraint(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    recorded = fields.get("structured_outputs")  # absent in records of older gateways
    return None if recorded is None else StructuredOutputsParams.from_spec(*recorded)


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps builds one a call


def encode_outputs(outputs: list[SequenceOutput]) -> str:
    return _ENCODE([[o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason,
                     o.num_cached_tokens] for o in outputs])


def decode_outputs(text: str) -> list[SequenceOutput]:
    """Recorded outputs, to render again. Their logprobs (and prompt logprobs) are
    placeholders: the view renders them only to reach the state it was in (a logprob's text
    offset counts tokens), and those chunks are dropped. Their cached-token counts are the
    first stream's, for the usage (absent in logs of older gateways)."""
    return [SequenceOutput(index, text, ids, [(0.0, {})] * len(ids), reason, stop,
                           num_cached_tokens=cached[0] if cached else None)
            for index, ids, text, reason, stop, *cached in json.loads(text or "[]")]


def sse_event(event_id: int, text: str) -> str:
    return f"id: {event_id}\n{text}"


def new_owner() -> str:
    """A token naming one gateway's hold on one stream."""
    return secrets.token_hex(8)


async def numbered(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """`events` with ids, not recorded (a gateway without an event log)."""
    async with contextlib.aclosing(events):
        n = 0
        async for text in events:
            yield sse_event(n, text)
            n += 1


def recorded_stream(
    log: EventLog | None, record: StreamRecord, view: StreamView,
    outputs: AsyncGenerator[SequenceOutput, None], gate: JoinGate | None = None,
) -> AsyncGenerator[str, None]:
    """The SSE events of a new stream (chunks, then [DONE]), numbered, and recorded in `log`;
    `gate`, the outputs' join gate, then asks the recorder."""
    if log is None:
        return numbered(sse_stream(record.request_id, view.chunks(outputs)))
    recorder = StreamRecorder(log, record.request_id, spec=record.to_json())
    if gate is not None:
        gate.check = recorder.may_join
    return recorder.record(sse_stream(record.request_id, view.chunks(recorder.tap(outputs))))


class StreamRecorder:
    """One stream's recording: new (`spec` given: the log opens with it and this gateway's
    lease) or taken over (`owner` already holds the lease; events go on from `next_id`).

    NOTE: joined outputs (merge_sequences joins a sequence's outputs that wait together) make
    an event's bounds depend on timing, and a take-over generates again the events its client
    got beyond the log (a dead gateway's last writes), each from one output. So an event that
    rendered a joined output leaves only once logged (the writer goes at once for it, about a
    round trip), and no output joins into an event the client has already (`may_join`); once
    recording stopped, nothing joins."""

    def __init__(self, log: EventLog, request_id: str, spec: str | None = None,
                 owner: str | None = None, next_id: int = 0) -> None:
        self.log, self.request_id, self.spec = log, request_id, spec or ""
        self.owner = owner or new_owner()
        self.next_id = next_id
        self.started = False  # record() has begun: the log's end is its to write
        self._outputs: list[SequenceOutput] = []  # consumed since the last event
        self._written: asyncio.Future[bool] | None = None  # the last submit's
        self._recording = True  # until Redis failed or the lease was lost
        self._after = -1  # the last event id the client has (record's `after`)

    def may_join(self) -> bool:
        """Whether outputs may join into the next event: one the client gets from here, and
        only while recording."""
        return self._recording and self.next_id > self._after

    async def tap(
        self, outputs: AsyncGenerator[SequenceOutput, None]
    ) -> AsyncGenerator[SequenceOutput, None]:
        """`outputs`, each noted as it goes to the view: the next event carries them."""
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                self._outputs.append(out)
                yield out

    async def record(
        self, events: AsyncGenerator[str, None], after: int = -1
    ) -> AsyncGenerator[str, None]:
        """`events` with ids from `next_id`, each recorded; ids up to `after` are recorded but
        not yielded (the client has them). Ends the log: done after the last event, or, when
        left early, the lease given up (after `events` is closed: generation is aborted first).
        The stream never waits for Redis, but at its end (END_WAIT_S at most)."""
        self.started = True
        self._after = after
        finished = False
        try:
            async with contextlib.aclosing(events):
                async for text in events:
                    joined = any(out.parts > 1 for out in self._outputs)
                    event_id = self._add(text, joined)
                    if joined and self._recording and self._written is not None:  # NOTE
                        await asyncio.wait({self._written})
                        self._still_recording()
                    if event_id > after:
                        yield sse_event(event_id, text)
            finished = True
        finally:
            if self._still_recording():
                end = self.log.submit(self.request_id, self.owner, [],
                                      "done" if finished else "release", self.spec)
                await asyncio.wait({end}, timeout=END_WAIT_S)  # it goes on if cancelled
                self._written = end
                self._still_recording()

    def _add(self, text: str, urgent: bool = False) -> int:
        """Number the event and submit it with the outputs it rendered (`urgent`: the stream
        waits for its write)."""
        event = LogEvent(self.next_id, text, encode_outputs(self._outputs))
        self._outputs = []
        self.next_id += 1
        if self._still_recording():
            self._written = self.log.submit(self.request_id, self.owner, [event],
                                            spec=self.spec, urgent=urgent)
            self.spec = ""  # the first write opens the log
        return event.id

    def _still_recording(self) -> bool:
        """Whether to go on: not once a write failed or found the lease taken (the stream goes
        on unrecorded: it can no longer be resumed)."""
        written = self._written
        if not self._recording or written is None or not written.done():
            return self._recording
        self._written = None
        if written.cancelled():
            return self._recording
        exc = written.exception()
        if exc is not None:
            logger.warning("%s: stream no longer recorded (not resumable): %s",
                           self.request_id, exc)
            self._recording = False
        elif not written.result():
            logger.warning("%s: stream lease lost, no longer recorded", self.request_id)
            self._recording = False
        return self._recording
