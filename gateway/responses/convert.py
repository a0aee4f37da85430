"""A Responses request as the chat request pdserve already serves, and the chat output as
Responses output items.

    instructions                  -> a system message first (this response only: not kept)
    previous_response_id          -> that response's conversation (its input and output), then
    input "text"                  -> a user message
    input [{role, content}]       -> messages ("developer" is a system message; content parts
                                     input_text / output_text joined)
    input function_call           -> an assistant message's tool call (consecutive ones: one
                                     message)
    input function_call_output    -> a tool message answering call_id
    tools / tool_choice           -> chat tools and tool_choice (flat function tools nested)
    text.format                   -> response_format (json_schema / json_object)
    max_output_tokens             -> max_tokens
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from gateway.errors import OpenAIError
from gateway.protocol import ChatCompletionRequest, random_id
from gateway.responses.protocol import FunctionCallItem, OutputMessage, OutputText, ResponsesRequest
from gateway.tools.parsers import ToolCall

_TEXT_PARTS = ("input_text", "output_text", "text")
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "user")


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request serving `req` after the stored conversation `history`. 400 naming
    the Responses field that cannot be served."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + input_messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages,
                            "max_tokens": req.max_output_tokens}
    body.update({k: getattr(req, k) for k in _SAMPLING if getattr(req, k) is not None})
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.text is not None and req.text.format.type != "text":
        body["response_format"] = _response_format(req)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise OpenAIError(f"input: {where}: {error['msg']}", param="input") from None


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages. 400 (`input`) for an item pdserve cannot take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item))
        elif kind == "function_call":
            call = {"id": _field(item, "call_id"), "type": "function", "function": {
                "name": _field(item, "name"), "arguments": _field(item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id"),
                             "content": text})
        else:
            raise OpenAIError(f"input items of type {kind!r} are not supported: pdserve takes "
                              "messages, function_call and function_call_output",
                              param="input")
    return messages


def output_items(content: str | None, calls: list[ToolCall]) -> list[OutputMessage |
                                                                     FunctionCallItem]:
    """The response's output: its text as one message, then each call."""
    items: list[OutputMessage | FunctionCallItem] = []
    if content:
        items.append(OutputMessage(id=random_id("msg"), content=[OutputText(text=content)]))
    items += [FunctionCallItem(id=random_id("fc"), call_id=c.id, name=c.name,
                               arguments=c.arguments) for c in calls]
    return items


def output_messages(content: str | None, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The output as the chat messages a later response's conversation continues from."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in calls]
    return [message]


def _message(item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise OpenAIError(f"input message role {role!r} is not supported", param="input")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS:
                raise OpenAIError(f"input content parts of type {kind!r} are not supported: "
                                  "pdserve serves text-only models", param="input")
            texts.append(part.get("text", ""))
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise OpenAIError("an input message's content must be text or text parts",
                          param="input")
    return {"role": "system" if role == "developer" else role, "content": content}


def _field(item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise OpenAIError(f"an input {item.get('type')} item needs {name} (a string)",
                          param="input")
    return value


def _response_format(req: ResponsesRequest) -> dict[str, Any]:
    assert req.text is not None
    fmt = req.text.format
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise OpenAIError("text.format json_schema needs a schema", param="text")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}
