"""`POST /v1/responses` and `GET /v1/responses/{id}`: the Responses API over the chat path.

NOTE: a request's life. Its conversation is the stored one of `previous_response_id` (404 when
unknown or expired) followed by its input; gateway/responses/convert.py turns that into the
chat request pdserve serves (chat template, tools, grammars, sampling: as on
/v1/chat/completions). The one sequence's output is read back as text and function calls
(gateway/tools/) and answered as output items, whole or as the Responses stream's events
(gateway/responses/stream.py). With `store` (the default) the response and its conversation are
kept for `previous_response_id` and retrieval.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from gateway.chat import chat_sampling_params, render_chat
from gateway.errors import OpenAIError
from gateway.protocol import ChatCompletionRequest, random_id
from gateway.responses.convert import chat_request, output_items, output_messages
from gateway.responses.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from gateway.responses.store import ResponseStore, StoredResponse
from gateway.responses.stream import ResponseStream
from gateway.sequence import SequenceOutput, SequenceResult
from gateway.serving import (
    ServingContext,
    UsageCount,
    check_prompt_ids,
    check_unknown_fields,
    fan_out,
    generate_outputs,
    start_stream,
    stream_response,
)
from gateway.tools.output import read_calls
from gateway.tools.plan import ToolPlan, plan_tools

_ECHOED = ("instructions", "previous_response_id", "parallel_tool_calls", "temperature", "top_p",
           "max_output_tokens", "user", "store")


class ResponsesServing:
    def __init__(self, ctx: ServingContext, store: ResponseStore) -> None:
        self.ctx, self.store = ctx, store

    async def create(self, req: ResponsesRequest) -> Response:
        """Serve one Responses request. Raises OpenAIError (400 naming the field, 404 for an
        unknown previous_response_id)."""
        arrival, response_id = time.monotonic(), random_id("resp")
        model, lora = await self.ctx.resolve_model(req.model)
        check_unknown_fields(response_id, req)  # type: ignore[arg-type]
        history = await self._history(req.previous_response_id)
        chat = chat_request(req, history)
        tools = plan_tools(chat, self.ctx.tool_parser)
        facts = await self.ctx.backend.model_info()
        prompt = await render_chat(self.ctx.backend, chat.messages, True, None,
                                   tools.tools if tools is not None else None)
        check_prompt_ids(prompt, facts, "input")
        params = chat_sampling_params(chat, len(prompt), facts, tools)
        specs = fan_out(response_id, [prompt], [params], lora)
        tracker = self.ctx.tracker(response_id, model, arrival, len(prompt), 1, req.stream)
        field = "tools" if tools is not None and tools.constrained else "text"
        events = generate_outputs(self.ctx, tracker, specs, field)
        turn = _Turn(self, req, response_id, model, chat, tools, len(prompt))
        if req.stream:
            return stream_response(response_id, turn.stream(await start_stream(events)))
        body = await turn.gather(events)
        return JSONResponse(body.model_dump(), headers={"X-Request-Id": response_id})

    async def retrieve(self, response_id: str) -> Response:
        stored = await self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.response)

    async def _history(self, previous: str | None) -> list[dict[str, Any]]:
        if previous is None:
            return []
        stored = await self.store.get(previous)
        if stored is None:
            raise _not_found(previous, "previous_response_id")
        return stored.messages


class _Turn:
    """One response being made: its settings, its conversation, how it ends."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, response_id: str,
                 model: str, chat: ChatCompletionRequest, tools: ToolPlan | None,
                 prompt_tokens: int) -> None:
        self.serving, self.req, self.chat = serving, req, chat
        self.tools = tools if tools is not None and tools.reads_calls else None
        self.count = UsageCount(prompt_tokens, 1)
        fields = {k: getattr(req, k) for k in _ECHOED}
        self.response = ResponseObject(
            id=response_id, created_at=int(time.time()), status="in_progress", model=model,
            tools=req.tools or [], tool_choice=req.tool_choice or "auto",
            text=req.text or ResponseObject.model_fields["text"].default,
            metadata=req.metadata or {},
            **{**fields, "parallel_tool_calls": req.parallel_tool_calls is not False},
        )

    async def gather(self, events: AsyncGenerator[SequenceOutput, None]) -> ResponseObject:
        result = SequenceResult(0)
        async with contextlib.aclosing(events):
            async for out in events:
                self.count.observe(out)
                result.add(out)
        content, calls = read_calls(self.tools, result.text) if self.tools else (result.text,
                                                                                  [])
        return await self.finish(output_items(content, calls), content, calls,
                                 result.finish_reason)

    def stream(self, events: AsyncGenerator[SequenceOutput, None]) -> AsyncGenerator[str, None]:
        return ResponseStream(self, self.tools).events(events)

    async def finish(self, items: list, content: str | None, calls: list,
                     finish_reason: str | None) -> ResponseObject:
        """The response completed (or cut by max_output_tokens): usage, status, stored."""
        usage = self.count.usage()
        self.response.output = items
        self.response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=sum(self.count.cached.values())))
        cut = finish_reason == "length"
        self.response.status = "incomplete" if cut else "completed"
        if cut:
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        if self.req.store:
            conversation = [m.model_dump(exclude_none=True) for m in self.chat.messages]
            if self.req.instructions:
                conversation = conversation[1:]  # instructions are this response's only
            await self.serving.store.put(self.response.id, StoredResponse(
                self.response.model_dump(), conversation + output_messages(content, calls)))
        return self.response


def _not_found(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", status=404,
                       param=param, code="not_found")
