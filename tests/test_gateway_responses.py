"""The Responses API on the colocated gateway (in-process app, real engine on the bundled model,
the official `openai` client): a response equals the chat completion of the same conversation,
streamed events assemble to the whole response, function tools and their outputs round trip,
`previous_response_id` continues a stored conversation, and what cannot be served is a 400
naming the field (404 for an unknown previous response). tests/test_frameworks.py runs the
OpenAI Agents SDK over it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from gateway.app import build_app
from gateway.local_backend import LocalBackend
from gateway.tools.plan import ToolCallConfig

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def http(bundled_async_engine: AsyncLLMEngine) -> Iterator[httpx.Client]:
    tools = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with TestClient(build_app(LocalBackend(bundled_async_engine, "smol"),
                              tool_calls=tools)) as client:
        yield client


@pytest.fixture(scope="module")
def client(http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)


def test_a_response_is_the_chat_completion_of_its_conversation(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smol", instructions="Be brief.", temperature=0,
                                input="What is the capital of France?", max_output_tokens=12)
    chat = client.chat.completions.create(
        model="smol", temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")
    assert r.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_streamed_events_assemble_to_the_response(client: openai.OpenAI) -> None:
    kwargs: Any = dict(model="smol", temperature=0, input="Name three colors.",
                       max_output_tokens=16)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_a_function_call_and_its_output_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model="smol", temperature=0, tools=[TOOL],
                                    tool_choice="required", input="Weather in Paris?")
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    streamed = list(client.responses.create(model="smol", temperature=0, tools=[TOOL],
                                            tool_choice="required", stream=True,
                                            input="Weather in Paris?"))
    args = "".join(e.delta for e in streamed
                   if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    follow = client.responses.create(
        model="smol", temperature=0, max_output_tokens=16, previous_response_id=first.id,
        tools=[TOOL], input=[{"type": "function_call_output", "call_id": call.call_id,
                              "output": "sunny, 24 C"}])
    assert follow.previous_response_id == first.id and follow.output


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="smol", temperature=0, max_output_tokens=8,
                                    input="My name is Ada. Say hello.")
    second = client.responses.create(model="smol", temperature=0, max_output_tokens=8,
                                     previous_response_id=first.id, input="What is my name?")
    replay = client.chat.completions.create(
        model="smol", temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": "My name is Ada. Say hello."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "What is my name?"}])
    assert second.output_text == replay.choices[0].message.content
    assert second.usage is not None and second.usage.input_tokens == replay.usage.prompt_tokens


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model="smol", temperature=0, max_output_tokens=40,
                                input="Name a city in Spain.",
                                text={"format": {"type": "json_schema", "name": "city",
                                                 "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"city"}


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "hi", "previous_response_id": "resp-unknown"}, 404, "previous_response_id"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text"),
])
def test_what_cannot_be_served_is_refused_by_name(http: httpx.Client, body: dict, status: int,
                                                  param: str) -> None:
    r = http.post("/v1/responses", json={"model": "smol", **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
