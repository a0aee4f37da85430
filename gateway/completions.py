"""`POST /v1/completions`: prompts (text or token ids, one or a batch) in, completions out,
streamed as SSE chunks or gathered into one response."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from engine.sampling_params import SamplingParams
from gateway.backend import ModelFacts
from gateway.errors import OpenAIError
from gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    random_id,
)
from gateway.recorder import StreamRecord, recorded_stream
from gateway.sequence import JoinGate, SequenceOutput, SequenceResult
from gateway.serving import (
    ServingContext,
    UsageCount,
    check_prompt_ids,
    check_token_controls,
    check_unknown_fields,
    clamp_logprob,
    common_sampling_fields,
    continuous_usage,
    fan_out,
    fit_context,
    generate_outputs,
    prompt_logprobs_of,
    sampling_params,
    start_stream,
    stream_response,
    token_text,
)
from gateway.structured import constraint_field

KIND = "completions"  # of its StreamRecords


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # None for token-id prompts (decoded only for echo)


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest) -> Response:
        """Serve one completions request: validate, tokenize, generate every (prompt, n)
        sequence concurrently, and answer with SSE or one JSON body. Raises OpenAIError."""
        arrival, request_id = time.monotonic(), random_id("cmpl")
        model, lora = await self.ctx.resolve_model(req.model)
        check_unknown_fields(request_id, req)
        _check_supported(req)
        facts = await self.ctx.backend.model_info()
        prompts = await self._prompts(req, facts)
        params = _sampling_params(req, prompts, facts)
        specs = fan_out(request_id, [p.token_ids for p in prompts], params, lora)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        tracker = self.ctx.tracker(request_id, model, arrival, num_prompt, len(specs), req.stream)
        view = _CompletionView(request_id, model, req, prompts, self.ctx.backend.get_tokenizer())
        gate = JoinGate()  # the stream's recorder decides
        events = generate_outputs(self.ctx, tracker, specs, constraint_field(req), gate)
        if req.stream:
            record = StreamRecord.of(
                KIND, request_id, model, view.created, req.model_dump(mode="json"),
                [p.token_ids for p in prompts], [p.text for p in prompts], params,
            )
            outputs = await start_stream(events)
            return stream_response(request_id,
                                   recorded_stream(self.ctx.events, record, view, outputs,
                                                   gate))
        return await view.response(events)

    async def _prompts(self, req: CompletionRequest, facts: ModelFacts) -> list[Prompt]:
        raw = req.prompt
        items: list[Any] = [raw] if isinstance(raw, str) or _is_token_ids(raw) else list(raw)
        if not items:
            raise OpenAIError("The prompt must not be empty.", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str) and not item:  # the tokenizer might add a BOS to ""
                raise OpenAIError("The prompt must not be empty.", param="prompt")
            if isinstance(item, str):
                prompt = Prompt(await self._tokenize(item), item)
            else:
                prompt = Prompt(list(item))
            check_prompt_ids(prompt.token_ids, facts, "prompt")
            prompts.append(prompt)
        return prompts

    async def _tokenize(self, text: str) -> list[int]:
        try:
            return await self.ctx.backend.tokenize(text)
        except ValueError as exc:
            raise OpenAIError(f"Cannot tokenize the prompt: {exc}", param="prompt") from exc


def restore_view(record: StreamRecord, tokenizer: Any) -> _CompletionView:
    """The view of a recorded stream, as it was when the stream began (gateway/resume.py)."""
    req = CompletionRequest.model_validate(record.body)
    prompts = [Prompt(ids, text) for ids, text in zip(record.prompts, record.prompt_texts)]
    view = _CompletionView(record.request_id, record.model, req, prompts, tokenizer)
    view.created = record.created
    return view


def _is_token_ids(raw: object) -> bool:
    return isinstance(raw, list) and bool(raw) and isinstance(raw[0], int)


def _check_supported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise OpenAIError("suffix is not currently supported", param="suffix")


def _echo_only(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens` 0 (OpenAI's legacy way to score a prompt, which vLLM serves
    too): the prompt alone comes back. One token is generated and left out."""
    return req.echo and req.max_tokens == 0


def _prompt_logprobs(req: CompletionRequest) -> int | None:
    """How many alternatives per prompt position the engine must compute: for `echo` with
    `logprobs` (the prompt's tokens lead the choice's logprobs) and for `prompt_logprobs`."""
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None)
             if k is not None]
    return max(asked) if asked else None


def _sampling_params(
    req: CompletionRequest, prompts: list[Prompt], facts: ModelFacts
) -> list[SamplingParams]:
    base = sampling_params(
        **common_sampling_fields(req), max_tokens=1 if _echo_only(req) else req.max_tokens,
        logprobs=req.logprobs, prompt_logprobs=_prompt_logprobs(req),
    )
    check_token_controls(base, facts)
    return [fit_context(base, len(p.token_ids), facts.max_model_len, "prompt") for p in prompts]


class _CompletionView:
    """Formats one request's sequence outputs as OpenAI completions (choices, chunks, usage)."""

    def __init__(
        self, request_id: str, model: str, req: CompletionRequest, prompts: list[Prompt],
        tokenizer: Any,
    ) -> None:
        self.request_id, self.model, self.req = request_id, model, req
        self.prompts, self.tokenizer = prompts, tokenizer
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p.token_ids) for p in prompts)
        self.echo_only = _echo_only(req)
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    async def response(self, events: AsyncGenerator[SequenceOutput, None]) -> Response:
        """Gather every sequence, then answer with one JSON body."""
        results: dict[int, SequenceResult] = {}
        count = UsageCount(self.prompt_tokens, self.req.n)
        async with contextlib.aclosing(events):
            async for out in events:
                out = self._shown(out)
                count.observe(out)
                results.setdefault(out.index, SequenceResult(out.index)).add(out)
        ordered = [results[i] for i in sorted(results)]
        choices = [self._choice(r) for r in ordered]
        body = CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=count.usage(),
        )
        return JSONResponse(body.model_dump(), headers={"X-Request-Id": self.request_id})

    async def chunks(
        self, events: AsyncGenerator[SequenceOutput, None]
    ) -> AsyncGenerator[str, None]:
        """SSE chunks of `events` (each with the usage so far for continuous usage stats),
        then the usage chunk when asked for."""
        count = UsageCount(self.prompt_tokens, self.req.n)
        async with contextlib.aclosing(events):
            async for out in events:
                out = self._shown(out)
                count.observe(out)
                if self._worth_sending(out):
                    chunk = CompletionStreamResponse(
                        id=self.request_id, created=self.created, model=self.model,
                        choices=[self._choice(out)],
                        usage=count.usage() if continuous_usage(self.req) else None,
                    )
                    yield f"data: {chunk.model_dump_json()}\n\n"
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            usage = CompletionStreamResponse(
                id=self.request_id, created=self.created, model=self.model, choices=[],
                usage=count.usage(),
            )
            yield f"data: {usage.model_dump_json()}\n\n"

    def _shown(self, out: SequenceOutput) -> SequenceOutput:
        """`out` as the client sees it: with `echo` and `max_tokens` 0, no generated token."""
        if not self.echo_only:
            return out
        return SequenceOutput(
            out.index, "", [], finish_reason="length" if out.finished else None,
            prompt_logprobs=out.prompt_logprobs, num_cached_tokens=out.num_cached_tokens,
        )

    def _worth_sending(self, out: SequenceOutput) -> bool:
        """Skip pieces with nothing to show (tokens whose text is held back)."""
        echo = self.req.echo and out.index not in self._echoed
        wants_logprobs = self.req.logprobs is not None and bool(out.token_ids)
        return bool(out.text) or out.finished or wants_logprobs or echo

    def _choice(self, out: SequenceOutput | SequenceResult) -> CompletionChoice:
        """One choice (or its next piece): echo prepended to its first piece, and with
        logprobs the prompt's tokens before the generated ones; vLLM's prompt_logprobs."""
        text, echo = out.text, self.req.echo and out.index not in self._echoed
        if echo:
            text = self._prompt_text(out.index) + text
        self._echoed.add(out.index)
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self._logprobs(out, echo)
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_of(
                self.tokenizer, self._prompt(out.index).token_ids, out.prompt_logprobs,
                self.req.prompt_logprobs)
        return CompletionChoice(
            index=out.index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason, prompt_logprobs=prompt_logprobs,
        )

    def _prompt(self, index: int) -> Prompt:
        return self.prompts[index // self.req.n]

    def _prompt_text(self, index: int) -> str:
        prompt = self._prompt(index)
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def _logprobs(self, out: SequenceOutput | SequenceResult, echo: bool) -> CompletionLogprobs:
        """OpenAI's legacy shape: per token its text, logprob, offset in the choice's text, and
        the top `logprobs` alternatives plus the chosen token (as vLLM returns them). With
        `echo`, the prompt's tokens come first, the first with no logprob (None)."""
        result = CompletionLogprobs()
        offset = self._offsets.get(out.index, 0)
        if echo:
            prompt = self._prompt(out.index).token_ids
            entries = [(lp, top) for lp, _, top in out.prompt_logprobs or []]
            steps: list[tuple[float, dict[int, float]] | None] = [None, *entries]
            steps += [None] * (len(prompt) - len(steps))  # none sent (a resumed stream)
            for token_id, step in zip(prompt, steps):
                offset = self._add_token(result, token_id, step, offset)
        for token_id, step in zip(out.token_ids, out.logprobs or []):
            offset = self._add_token(result, token_id, step, offset)
        self._offsets[out.index] = offset
        return result

    def _add_token(
        self, result: CompletionLogprobs, token_id: int,
        step: tuple[float, dict[int, float]] | None, offset: int,
    ) -> int:
        """Append one token at `offset` of the text (no logprob for `step` None); the offset
        after it."""
        text = token_text(self.tokenizer, token_id)
        result.tokens.append(text)
        result.text_offset.append(offset)
        if step is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            return offset + len(text)
        chosen, top = step
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[: self.req.logprobs]
        alternatives = {token_text(self.tokenizer, t): clamp_logprob(lp) for t, lp in ranked}
        alternatives.setdefault(text, clamp_logprob(chosen))
        result.token_logprobs.append(clamp_logprob(chosen))
        result.top_logprobs.append(alternatives)
        return offset + len(text)
