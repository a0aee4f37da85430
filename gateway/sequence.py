"""One sequence's life at the gateway, and `n` of them merged into one stream.

A backend moves token ids; each sequence turns them into text here: incremental detokenization
(a multi-byte character is never split) and stop strings (a stop string split over several
deltas is never shown in part). A matched stop string ends the sequence: its backend generator
is closed, which aborts the request in the backend and frees its KV blocks.

NOTE: cancellation. `merge_sequences` drains each sequence in its own task. Leaving it early
(client gone, error in a sibling) cancels those tasks; the cancellation lands inside each
backend generator, whose cleanup aborts the request. The cleanup is shielded from the repeated
cancellation that Starlette's task group delivers, so it always runs to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.detokenizer import IncrementalDetokenizer
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from engine.stop_checker import StopStringMatcher
from gateway.backend import Backend, PromptTokenLogprobs, TokenDelta, TokenLogprobs


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate: choice `index` of the response."""

    index: int
    request_id: str  # the backend's request id
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1
    prior_token_ids: list[int] = field(default_factory=list)  # output before (stream resumed)
    lora: LoRARequest | None = None  # the LoRA adapter it runs under; None: the base model


@dataclass
class SequenceOutput:
    """What one sequence produced since its previous output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id
    prompt_logprobs: list[PromptTokenLogprobs] | None = None  # first output only (TokenDelta)
    num_cached_tokens: int | None = None  # first output only
    parts: int = 1  # the backend's outputs it joins (merge_sequences)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def joined(self, later: SequenceOutput) -> SequenceOutput:
        """This output and the same sequence's next one as one output."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        first = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        cached = self.num_cached_tokens
        return SequenceOutput(
            self.index, self.text + later.text, self.token_ids + later.token_ids, logprobs,
            later.finish_reason, later.stop_reason, first,
            cached if cached is not None else later.num_cached_tokens, self.parts + later.parts,
        )


@dataclass
class SequenceResult:
    """A whole sequence, gathered from its outputs (non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[PromptTokenLogprobs] | None = None
    num_cached_tokens: int = 0

    def add(self, out: SequenceOutput) -> None:
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens or 0)
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.finish_reason = out.finish_reason or self.finish_reason
        self.stop_reason = out.stop_reason if out.finished else self.stop_reason


class SequenceDecoder:
    """Token deltas of one sequence in, text deltas out (detokenizer + stop strings).

    A resumed sequence's decoder first takes its prior tokens as the first stream did (one at a
    time: what `decode` does with any delta) and drops their text, which that stream sent:
    text held back then (a partial character, a possible stop string) comes out as it would
    have."""

    def __init__(self, tokenizer: Any, spec: SequenceSpec) -> None:
        params = spec.params
        self.index = spec.index
        self.detok = IncrementalDetokenizer(
            tokenizer, spec.prompt_token_ids, params.skip_special_tokens
        )
        self.include_stop = params.include_stop_str_in_output
        self.matcher = None
        if params.stop_list:
            self.matcher = StopStringMatcher(params.stop_list, params.include_stop_str_in_output)
        for token_id in spec.prior_token_ids:
            self.decode(TokenDelta([token_id]))

    def decode(self, delta: TokenDelta) -> SequenceOutput:
        """Text of `delta`'s tokens, fed one token at a time so that a stop string ends the
        output at the token that completed it (later tokens of the delta are dropped). A token
        that stopped the sequence (eos, stop_token_ids) stays in the ids but, as in vLLM, adds
        no text unless `include_stop_str_in_output`."""
        out = self._decode(delta)
        out.prompt_logprobs, out.num_cached_tokens = delta.prompt_logprobs, delta.num_cached_tokens
        return out

    def _decode(self, delta: TokenDelta) -> SequenceOutput:
        ids, text = delta.token_ids, ""
        steps = [[token_id] for token_id in ids] or [[]]
        if delta.finish_reason == "stop" and ids and not self.include_stop:
            steps[-1] = []
        for i, step in enumerate(steps):
            final = delta.finish_reason is not None and i == len(steps) - 1
            piece, stop = self._feed(self.detok.step(step), final)
            text += piece
            if stop is not None:
                kept = ids[: i + 1]
                logprobs = None if delta.logprobs is None else delta.logprobs[: i + 1]
                return SequenceOutput(self.index, text, kept, logprobs, "stop", stop)
        return SequenceOutput(
            self.index, text, list(ids), delta.logprobs, delta.finish_reason, delta.stop_reason
        )

    def _feed(self, text: str, finished: bool) -> tuple[str, str | None]:
        if finished:
            text += self.detok.flush()
        if self.matcher is None:
            return text, None
        emitted, stop = self.matcher.feed(text)
        if stop is None and finished:
            emitted += self.matcher.flush()
        return emitted, stop


async def generate_sequence(
    backend: Backend, tokenizer: Any, spec: SequenceSpec
) -> AsyncGenerator[SequenceOutput, None]:
    """Stream one sequence's text until it finishes; the last output has a finish_reason.

    Always closes the backend generator (stop string, error, cancellation), which aborts the
    request in the backend if it is still running. A stream that ends without a finish_reason
    (the backend aborted it) finishes with "abort".
    """
    decoder = SequenceDecoder(tokenizer, spec)
    params = spec.params.clone(stop=None, include_stop_str_in_output=False)  # ours to apply
    prior = (spec.prior_token_ids,) if spec.prior_token_ids else ()  # only when resumed
    if prior:  # the first stream had the prompt's logprobs
        params = params.clone(prompt_logprobs=None)
    adapter = {"lora_request": spec.lora} if spec.lora is not None else {}
    stream = backend.generate(spec.request_id, spec.prompt_token_ids, params, *prior, **adapter)
    try:
        async for delta in stream:
            out = decoder.decode(delta)
            if prior:  # its first output, logged, told the prompt's hits; not this re-prefill's
                out.num_cached_tokens = None
            yield out
            if out.finished:
                return
        yield SequenceOutput(spec.index, "", [], finish_reason="abort")
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()


_DONE = object()


class JoinGate:
    """`merge_sequences`' `may_join` for a stream whose recorder comes after its generation
    starts: joins go until `check` (the recorder's) says no."""

    def __init__(self) -> None:
        self.check: Callable[[], bool] | None = None

    def __call__(self) -> bool:
        return self.check is None or self.check()


async def merge_sequences(
    streams: list[AsyncGenerator[SequenceOutput, None]],
    may_join: Callable[[], bool] | None = None,
) -> AsyncGenerator[SequenceOutput, None]:
    """Outputs of all `streams` as they come, generated concurrently. A sequence's outputs that
    wait here together (its stream got ahead of the client's writes: a busy event loop) leave
    as one, as vLLM's output collector merges a request's deltas: a gateway that falls behind
    sends fewer, larger chunks rather than falling further behind. Nothing ever waits to be
    joined: an output leaves as soon as the queue holds nothing more. `may_join()` false: each
    output leaves alone (a resumed stream's events must fall as the first stream's did).

    The first error of any stream is raised here; leaving early or failing cancels every stream
    and waits for their cleanup (their backend requests are aborted).
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def drain(stream: AsyncGenerator[SequenceOutput, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer below
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    held: dict[int, SequenceOutput] = {}  # by choice index: outputs taken, not yet yielded
    try:
        remaining = len(tasks)
        while remaining or held:
            if held and (queue.empty() or not remaining):
                for out in held.values():
                    yield out
                held.clear()
                continue
            item = await queue.get()  # at once while the queue holds items
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                for out in held.values():
                    yield out
                held.clear()
                raise item
            else:
                before = held.get(item.index)
                if before is not None and may_join is not None and not may_join():
                    yield before
                    before = None
                held[item.index] = item if before is None else before.joined(item)
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
