"""`POST /v1/chat/completions`: a conversation in (rendered by the model's chat template),
assistant messages out, streamed as SSE chunks or gathered into one response; with tools, the
output read back as content and tool calls (gateway/tools/)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from engine.sampling_params import SamplingParams
from gateway.backend import Backend, ModelFacts, TokenLogprobs
from gateway.errors import OpenAIError
from gateway.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
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
from gateway.tools.output import CallStream, delta_message, finish_reason, read_calls, wire_call
from gateway.tools.plan import ToolPlan, plan_tools
from tokenizer_svc.chat_template import CANNOT_RENDER_TOOLS

KIND = "chat"  # of its StreamRecords


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest) -> Response:
        """Serve one chat request: validate, apply the chat template, generate the `n`
        sequences concurrently, and answer with SSE or one JSON body. Raises OpenAIError."""
        arrival, request_id = time.monotonic(), random_id("chatcmpl")
        model, lora = await self.ctx.resolve_model(req.model)
        check_unknown_fields(request_id, req)
        tools = plan_tools(req, self.ctx.tool_parser)
        facts = await self.ctx.backend.model_info()
        prompt = await self._render(req, tools)
        check_prompt_ids(prompt, facts, "messages")
        params = chat_sampling_params(req, len(prompt), facts, tools)
        specs = fan_out(request_id, [prompt], [params], lora)
        tracker = self.ctx.tracker(request_id, model, arrival, len(prompt), len(specs), req.stream)
        view = _ChatView(request_id, model, req, prompt, self.ctx.backend.get_tokenizer(),
                         tools)
        field = "tools" if tools is not None and tools.constrained else constraint_field(req)
        gate = JoinGate()  # the stream's recorder decides
        events = generate_outputs(self.ctx, tracker, specs, field, gate)
        if req.stream:
            record = StreamRecord.of(KIND, request_id, model, view.created,
                                     req.model_dump(mode="json"), [prompt], [None], [params],
                                     tool_parser=tools.parser if tools is not None else None)
            outputs = await start_stream(events)
            return stream_response(request_id,
                                   recorded_stream(self.ctx.events, record, view, outputs,
                                                   gate))
        return await view.response(events)

    async def _render(self, req: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
        return await render_chat(self.ctx.backend, req.messages, req.add_generation_prompt,
                                 req.chat_template, tools.tools if tools is not None else None)


async def render_chat(
    backend: Backend, messages: list[ChatMessage], add_generation_prompt: bool,
    chat_template: str | None, tools: list[dict[str, Any]] | None,
) -> list[int]:
    """The conversation's token ids after the chat template; 400 naming `messages` (or
    `tools`, when the template cannot render them) if it fails."""
    try:
        return await backend.apply_chat_template(
            [_message_dict(m) for m in messages], add_generation_prompt, chat_template, tools)
    except ValueError as exc:
        param = "tools" if CANNOT_RENDER_TOOLS in str(exc) else "messages"
        raise OpenAIError(f"Cannot apply the chat template: {exc}", param=param) from exc


def restore_view(record: StreamRecord, tokenizer: Any) -> _ChatView:
    """The view of a recorded stream, as it was when the stream began (gateway/resume.py)."""
    req = ChatCompletionRequest.model_validate(record.body)
    view = _ChatView(record.request_id, record.model, req, record.prompts[0], tokenizer,
                     plan_tools(req, record.tool_parser))
    view.created = record.created
    return view


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: content as text ("" for none), and its name,
    tool calls and tool_call_id where given."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [call.template_dict() for call in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def chat_sampling_params(
    req: ChatCompletionRequest, prompt_len: int, facts: ModelFacts, tools: ToolPlan | None
) -> SamplingParams:
    """The request's sampling params (with the tool grammar of a required or named choice),
    fitted to the context; 400 naming the field otherwise."""
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
    use_new = req.max_completion_tokens is not None
    renames = {
        "logprobs": "top_logprobs",
        "max_tokens": "max_completion_tokens" if use_new else "max_tokens",
    }
    fields = common_sampling_fields(req)
    if tools is not None and tools.constrained:  # the one constraint (plan_tools checked)
        fields["structured_outputs"] = tools.constraint()
    base = sampling_params(
        renames,
        **fields,
        max_tokens=req.max_completion_tokens if use_new else req.max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
    )
    check_token_controls(base, facts)
    return fit_context(base, prompt_len, facts.max_model_len, "messages", renames)


class _ChatView:
    """Formats one request's sequence outputs as OpenAI chat completions."""

    def __init__(
        self, request_id: str, model: str, req: ChatCompletionRequest, prompt: list[int],
        tokenizer: Any, tools: ToolPlan | None = None,
    ) -> None:
        self.request_id, self.model, self.req = request_id, model, req
        self.prompt, self.prompt_tokens, self.tokenizer = prompt, len(prompt), tokenizer
        self.created = int(time.time())
        self.tools = tools if tools is not None and tools.reads_calls else None
        self.call_streams: dict[int, CallStream] = {}  # per choice, when streamed with tools

    async def response(self, events: AsyncGenerator[SequenceOutput, None]) -> Response:
        """Gather every sequence, then answer with one JSON body."""
        results: dict[int, SequenceResult] = {}
        count = UsageCount(self.prompt_tokens, self.req.n)
        async with contextlib.aclosing(events):
            async for out in events:
                count.observe(out)
                results.setdefault(out.index, SequenceResult(out.index)).add(out)
        ordered = [results[i] for i in sorted(results)]
        choices = [self._choice(r) for r in ordered]
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None:  # the prompt's, as its first sample saw it
            prompt_logprobs = prompt_logprobs_of(self.tokenizer, self.prompt,
                                                 ordered[0].prompt_logprobs,
                                                 self.req.prompt_logprobs)
        body = ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=count.usage(), prompt_logprobs=prompt_logprobs,
        )
        return JSONResponse(body.model_dump(), headers={"X-Request-Id": self.request_id})

    def _choice(self, r: SequenceResult) -> ChatCompletionChoice:
        content, calls = read_calls(self.tools, r.text) if self.tools else (r.text, [])
        message = AssistantMessage(content=content, tool_calls=[wire_call(c) for c in calls])
        return ChatCompletionChoice(
            index=r.index, message=message, logprobs=self._logprobs(r.token_ids, r.logprobs),
            finish_reason=finish_reason(r.finish_reason, bool(calls)),
            stop_reason=r.stop_reason,
        )

    async def chunks(
        self, events: AsyncGenerator[SequenceOutput, None]
    ) -> AsyncGenerator[str, None]:
        """SSE chunks: each choice opens with the assistant role, then its content deltas (each
        with the usage so far for continuous usage stats); the usage chunk comes last when
        asked for."""
        count = UsageCount(self.prompt_tokens, self.req.n)
        continuous = continuous_usage(self.req)
        for index in range(self.req.n):
            yield self._chunk(ChatStreamChoice(index=index, delta=_role_delta()),
                              count.usage() if continuous else None)
        async with contextlib.aclosing(events):
            async for out in events:
                count.observe(out)
                for choice in self._stream_choices(out):
                    yield self._chunk(choice, count.usage() if continuous else None)
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield self._chunk(None, count.usage())

    def _stream_choices(self, out: SequenceOutput) -> list[ChatStreamChoice]:
        """The chunks' choices `out` makes: its text as one content delta, or, with tools, the
        content and call deltas it completes. The first carries the logprobs, the last the
        finish reason; one empty delta carries them when there is nothing else to send."""
        reason = out.finish_reason
        if self.tools is None:
            deltas = [DeltaMessage(content=out.text)] if out.text else []
        else:
            stream = self.call_streams.setdefault(out.index, CallStream(self.tools))
            deltas = [delta_message(d) for d in stream.feed(out.text, out.finished)]
            reason = finish_reason(reason, stream.called)
        if not deltas and (out.finished or (self.req.logprobs and out.token_ids)):
            deltas = [DeltaMessage()]
        choices = [ChatStreamChoice(index=out.index, delta=d) for d in deltas]
        if choices:
            choices[0].logprobs = self._logprobs(out.token_ids, out.logprobs)
            choices[-1].finish_reason, choices[-1].stop_reason = reason, out.stop_reason
        return choices

    def _chunk(self, choice: ChatStreamChoice | None, usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model,
            choices=[] if choice is None else [choice], usage=usage,
        )
        return f"data: {chunk.model_dump_json()}\n\n"

    def _logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> ChatChoiceLogprobs | None:
        """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and the top
        `top_logprobs` alternatives, most likely first."""
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for token_id, (chosen, top) in zip(token_ids, logprobs or []):
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            alternatives = [self._top(t, lp) for t, lp in ranked]
            chosen_entry = self._top(token_id, chosen).model_dump()
            content.append(TokenLogprob(**chosen_entry, top_logprobs=alternatives))
        return ChatChoiceLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = token_text(self.tokenizer, token_id)
        raw = list(text.encode("utf-8", "replace"))
        return TopLogprob(token=text, logprob=clamp_logprob(logprob), bytes=raw)


def _role_delta() -> DeltaMessage:
    return DeltaMessage(role="assistant", content="")
