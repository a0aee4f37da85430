"""What completions and chat share: request -> `SamplingParams`, the context-length check, the
fan-out of `n` and of batched prompts into sequences, and the plumbing of streamed and
disconnect-aware responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from gateway.backend import (
    Backend,
    BackendError,
    ModelFacts,
    PromptTokenLogprobs,
    RequestRejected,
)
from gateway.errors import OpenAIError, from_backend_error
from gateway.lora import LoRAModels
from gateway.metrics import GatewayMetrics
from gateway.protocol import (
    ErrorResponse,
    OpenAIRequest,
    PromptLogprob,
    PromptLogprobs,
    UsageInfo,
)
from gateway.sequence import SequenceOutput, SequenceSpec, generate_sequence, merge_sequences
from gateway.structured import structured_outputs_of
from gateway.tracker import RequestTracker, StateStore
from pdserve.cluster.event_log import EventLog

logger = logging.getLogger("pdserve.gateway")

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
# A request field the gateway does not know is refused by name unless its value asks for
# nothing (null, false, empty, "none", or the default below: clients send some always); never
# dropped silently. Why some known OpenAI fields are refused; chat requests declare the tool
# fields (gateway/tools/): these are refused on completions.
UNSUPPORTED_FIELDS = {
    "tools": "tool calling is served by /v1/chat/completions",
    "tool_choice": "tool calling is served by /v1/chat/completions",
    "parallel_tool_calls": "tool calling is served by /v1/chat/completions",
    "functions": "deprecated function calling is not served: use tools",
    "function_call": "deprecated function calling is not served: use tools and tool_choice",
}
_ASKS_NOTHING = (None, [], {}, "none")
# Unknown fields whose value here asks for nothing more than what pdserve does anyway.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {"best_of": (1,), "service_tier": ("auto", "default")}
_ANY_VALUE = ("metadata",)  # tags for the caller's records: they change no output


@dataclass
class ServingContext:
    backend: Backend
    metrics: GatewayMetrics
    store: StateStore | None = None
    served_model_name: str | None = None
    events: EventLog | None = None  # where streams are recorded, to be resumed (Redis)
    tool_parser: str | None = None  # the parser of tool_choice "auto"; None: not enabled
    loras: LoRAModels | None = None  # the LoRA adapters served (--enable-lora); None: none

    async def model_name(self) -> str:
        if self.served_model_name is not None:
            return self.served_model_name
        return (await self.backend.model_info()).model_name

    async def check_model(self, requested: str | None) -> str:
        """The name of the model a request names (the served model when it names none); 404
        when it is neither the served model nor one of its LoRA adapters."""
        return (await self.resolve_model(requested))[0]

    async def resolve_model(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model a request names and, for a LoRA adapter's name, the adapter (None: the
        served model itself); 404 model_not_found for any other name."""
        name = await self.model_name()
        if requested is None or requested == name:
            return name, None
        lora = None if self.loras is None else await self.loras.resolve(requested)
        if lora is None:
            raise OpenAIError(
                f"The model `{requested}` does not exist.", 404, "model", "model_not_found"
            )
        return requested, lora

    def tracker(
        self, request_id: str, model: str, arrival: float, prompt_tokens: int,
        num_choices: int, stream: bool,
    ) -> RequestTracker:
        return RequestTracker(
            self.metrics, self.store, request_id, model, arrival, prompt_tokens, num_choices,
            stream,
        )


# ---- request -> sampling params ----------------------------------------------------------
def sampling_params(renames: dict[str, str] | None = None, **fields: Any) -> SamplingParams:
    """`SamplingParams(**fields)`; a ValueError becomes a 400 naming the request's field
    (`renames` maps SamplingParams names to request names, e.g. logprobs -> top_logprobs)."""
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        message = str(exc)
        name = message.replace("(", " ").split(" ", 1)[0]
        param = (renames or {}).get(name, name) if name in _SAMPLING_FIELDS else None
        raise OpenAIError(message, param=param) from None


def common_sampling_fields(req: OpenAIRequest) -> dict[str, Any]:
    """The sampling fields completions and chat requests share, with OpenAI's defaults."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise OpenAIError(  # vLLM's rule: they are not sent in chunks
            "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
        )
    return {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "structured_outputs": structured_outputs_of(req),
        "logit_bias": req.logit_bias or None,
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words,
    }


def fit_context(
    params: SamplingParams,
    prompt_len: int,
    max_model_len: int,
    prompt_param: str,
    renames: dict[str, str] | None = None,
) -> SamplingParams:
    """`params` with max_tokens set: as asked, or the room the context has left. 400
    context_length_exceeded (OpenAI's wording) when prompt and completion do not fit."""
    room = max_model_len - prompt_len
    completion = params.max_tokens if params.max_tokens is not None else max(room, 1)
    if completion > room:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + completion} tokens ({prompt_len} in the messages, "
            f"{completion} in the completion). Please reduce the length of the messages or "
            "completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    fields = {f: getattr(params, f) for f in _SAMPLING_FIELDS}
    return sampling_params(renames, **{**fields, "max_tokens": completion})


def check_token_controls(params: SamplingParams, facts: ModelFacts) -> None:
    """400 naming the field when logit_bias or allowed_token_ids holds an id outside the
    vocabulary (the engine would refuse it at the worker; this says which field)."""
    for name in ("logit_bias", "allowed_token_ids"):
        bad = [t for t in getattr(params, name) or () if not 0 <= t < facts.vocab_size]
        if bad:
            raise OpenAIError(f"{name} holds token id {bad[0]}, out of vocabulary (size "
                              f"{facts.vocab_size}).", param=name)


def check_prompt_ids(token_ids: list[int], facts: ModelFacts, param: str) -> None:
    if not token_ids:
        raise OpenAIError("The prompt must not be empty.", param=param)
    bad = [t for t in token_ids if not 0 <= t < facts.vocab_size]
    if bad:
        raise OpenAIError(
            f"Token id {bad[0]} is out of vocabulary (size {facts.vocab_size}).", param=param
        )


def fan_out(
    request_id: str, prompts: list[list[int]], params: list[SamplingParams],
    lora: LoRARequest | None = None,
) -> list[SequenceSpec]:
    """One sequence per (prompt, sample): choice index `j * n + i`, backend request id
    `{request_id}-{index}` (the bare id when there is a single sequence), seed + i; each under
    the LoRA adapter `lora` (None: the base model)."""
    total = sum(p.n for p in params)
    specs: list[SequenceSpec] = []
    for token_ids, p in zip(prompts, params):
        for i in range(p.n):
            index = len(specs)
            backend_id = request_id if total == 1 else f"{request_id}-{index}"
            seed = None if p.seed is None else p.seed + i
            specs.append(SequenceSpec(index, backend_id, token_ids, p.clone(n=1, seed=seed),
                                      lora=lora))
    return specs


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's text, as shown in logprobs (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def clamp_logprob(logprob: float) -> float:
    """JSON has no -inf: floor log-probabilities at -9999 as vLLM does."""
    return max(logprob, -9999.0)


def prompt_logprobs_of(
    tokenizer: Any, prompt: list[int], entries: list[PromptTokenLogprobs] | None, k: int
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per position its top k
    (ranks 1..k) and the prompt token at its own rank, each with its decoded text. Positions
    the backend did not send (a resumed stream) are None."""
    out: PromptLogprobs = [None]
    for token_id, entry in zip(prompt[1:], entries or [None] * (len(prompt) - 1)):
        if entry is None:
            out.append(None)
            continue
        chosen, rank, top = entry
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        step = {t: _prompt_logprob(tokenizer, t, lp, j + 1) for j, (t, lp) in enumerate(ranked)}
        step[token_id] = _prompt_logprob(tokenizer, token_id, chosen, rank)
        out.append(step)
    return out


def _prompt_logprob(tokenizer: Any, token_id: int, logprob: float, rank: int) -> PromptLogprob:
    return PromptLogprob(logprob=clamp_logprob(logprob), rank=rank,
                         decoded_token=token_text(tokenizer, token_id))


def check_unknown_fields(request_id: str, req: OpenAIRequest) -> None:
    """400 naming the first field the gateway does not know whose value asks for something
    (`UNSUPPORTED_FIELDS` says why for OpenAI's); the rest (values asking for nothing) are
    logged as ignored."""
    extra = req.model_extra or {}
    for name in sorted(extra):
        value = extra[name]
        if _asks_nothing(name, value):
            continue
        why = UNSUPPORTED_FIELDS.get(name, "pdserve does not implement this field")
        raise OpenAIError(f"{name} is not supported: {why}.", param=name)
    if extra:
        logger.info("%s: ignoring fields that ask for nothing: %s", request_id, sorted(extra))


def _asks_nothing(name: str, value: Any) -> bool:
    """An unknown field's value that changes nothing pdserve does (see `_NO_OP_VALUES`)."""
    if name in _ANY_VALUE or value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    return value in _ASKS_NOTHING or value in _NO_OP_VALUES.get(name, ())


async def generate_outputs(
    ctx: ServingContext, tracker: RequestTracker, specs: list[SequenceSpec],
    constraint_field: str | None = None, may_join: Callable[[], bool] | None = None,
) -> AsyncGenerator[SequenceOutput, None]:
    """Every sequence's outputs, generated concurrently and accounted for by `tracker`; a
    sequence's outputs waiting together join unless `may_join()` says no (merge_sequences).
    The engine refusing the request (RequestRejected: the constraint does not compile) is a
    400 naming `constraint_field`, the request field the constraint came from."""
    tokenizer = ctx.backend.get_tokenizer()
    try:
        async with tracker:
            streams = [generate_sequence(ctx.backend, tokenizer, spec) for spec in specs]
            async with contextlib.aclosing(merge_sequences(streams, may_join)) as merged:
                async for out in merged:
                    tracker.observe(out)
                    yield out
    except RequestRejected as exc:
        raise OpenAIError(str(exc), param=constraint_field) from exc


# ---- responses ---------------------------------------------------------------------------
@dataclass
class UsageCount:
    """A request's token counts so far, for its `usage` (and vLLM's continuous usage stats).
    A prompt counts once however many samples (`n`) it has: so do its cached tokens, which
    its first sample reports."""

    prompt_tokens: int
    n: int
    completion_tokens: int = 0
    cached: dict[int, int] = dataclasses.field(default_factory=dict)  # prompt -> its hits

    def observe(self, out: SequenceOutput) -> None:
        self.completion_tokens += len(out.token_ids)
        if out.num_cached_tokens is not None and out.index % self.n == 0:
            self.cached[out.index // self.n] = out.num_cached_tokens

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens,
                            sum(self.cached.values()))


def continuous_usage(req: OpenAIRequest) -> bool:
    """Usage on every streamed chunk (vLLM: `include_usage` and `continuous_usage_stats`)."""
    options = req.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


async def run_until_disconnect(raw: Request, work: Coroutine[Any, Any, T]) -> T | Response:
    """Await `work` unless the client disconnects first: then cancel it (which aborts its
    sequences in the backend) and answer 499. The request body must have been read already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def start_stream(events: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Wait for the first item, so a failure before it (e.g. no worker free) raises here and
    is answered with its status rather than inside a 200 stream; then yield it and the rest."""
    first = await anext(events)

    async def chained() -> AsyncGenerator[T, None]:
        async with contextlib.aclosing(events):
            yield first
            async for item in events:
                yield item

    return chained()


async def sse_stream(
    request_id: str, chunks: AsyncGenerator[str, None]
) -> AsyncGenerator[str, None]:
    """`chunks` then `data: [DONE]`; a failure mid-stream becomes an OpenAI error event."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except (OpenAIError, BackendError) as exc:
        error = exc if isinstance(exc, OpenAIError) else from_backend_error(exc)
        yield f"data: {ErrorResponse(error=error.info()).model_dump_json()}\n\n"
    except Exception:  # noqa: BLE001 - logged by the tracker; the client gets a clean error
        error = OpenAIError("Internal server error", status=500)
        logger.warning("%s: stream failed", request_id)
        yield f"data: {ErrorResponse(error=error.info()).model_dump_json()}\n\n"
    yield SSE_DONE


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator, even when the client went
    away while the body was suspended (Starlette leaves it suspended), so the backend aborts."""

    body_iterator: AsyncGenerator[str, None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def stream_response(request_id: str, events: AsyncGenerator[str, None]) -> Response:
    """The response streaming `events`, each the whole text of one SSE event."""
    return ClosingStreamingResponse(
        events, media_type="text/event-stream", headers={"X-Request-Id": request_id},
    )
