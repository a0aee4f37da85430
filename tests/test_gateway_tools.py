"""Tool calling through the colocated gateway on the bundled model (in-process app, real
engine), driven by the official `openai` client: required and named calls that fit the
function's parameters, "auto" read back by the hermes parser, a tool round trip, streamed calls
equal to whole ones, and the 400s. The template's choice runs alone at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from gateway.app import build_app
from gateway.local_backend import LocalBackend
from gateway.tools.plan import AUTO_NEEDS_FLAGS, ToolCallConfig
from tokenizer_svc.chat_template import CANNOT_RENDER_TOOLS, TOOLS_TEMPLATE_PATH, ChatRenderer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "add", "parameters": ADD,
                                      "description": "Add two integers"}},
]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GREEDY: Any = {"model": "smol", "temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def engine(bundled_async_engine: AsyncLLMEngine) -> AsyncLLMEngine:
    return bundled_async_engine


@contextmanager
def openai_client(engine: AsyncLLMEngine, **app_kw: Any) -> Iterator[openai.OpenAI]:
    with TestClient(build_app(LocalBackend(engine, "smol"), **app_kw)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                            max_retries=0)


@pytest.fixture(scope="module")
def client(engine: AsyncLLMEngine) -> Iterator[openai.OpenAI]:
    with openai_client(engine, tool_calls=ToolCallConfig(True, "hermes")) as c:
        yield c


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, the arguments checked against the function's schema."""
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, dict]], str]:
    """A streamed response assembled: (content, calls, finish_reason)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: id, type and name, no arguments yet
                assert d.type == "function" and d.function.arguments == ""
                calls[d.index] = [d.function.name, ""]
            else:
                calls[d.index][1] += d.function.arguments
        reason = choice.finish_reason or reason
    return content, [(n, json.loads(a)) for n, a in calls.values()], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}])
def test_forced_calls_fit_the_parameters(client: openai.OpenAI, choice: Any) -> None:
    """One call each (the 135M model would repeat calls until max_tokens when allowed)."""
    r = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, n=2, temperature=1.0, seed=7,
                                       max_tokens=64)
    for c in r.choices:  # each choice read on its own
        assert (c.finish_reason, c.message.content) == ("tool_calls", None)
        [(name, _)] = calls_of(c.message)
        assert isinstance(choice, str) or name == "add"


def test_a_streamed_call_equals_the_whole_one(client: openai.OpenAI) -> None:
    kw = {**GREEDY, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    whole = client.chat.completions.create(**kw).choices[0]
    assert streamed(client, **kw) == ("", calls_of(whole.message), "tool_calls")


def test_auto_answers_text_or_calls(client: openai.OpenAI) -> None:
    """What the model chose is its business; the response is well-formed either way."""
    r = client.chat.completions.create(messages=ASK, tools=TOOLS, **GREEDY)
    c = r.choices[0]
    if c.message.tool_calls:
        assert calls_of(c.message) and c.finish_reason == "tool_calls"
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")
        assert "<tool_call>" not in c.message.content


def test_auto_reads_the_models_calls(client: openai.OpenAI) -> None:
    """The output forced to a Hermes call (a guided choice): parsed, whole and streamed."""
    kw = {**GREEDY, "messages": ASK, "tools": TOOLS,
          "extra_body": {"structured_outputs": {"choice": [HERMES_CALL]}}}
    c = client.chat.completions.create(**kw).choices[0]
    expected = [("get_weather", {"city": "Paris"})]
    assert (c.message.content, calls_of(c.message), c.finish_reason) == (None, expected,
                                                                         "tool_calls")
    assert streamed(client, **kw) == ("", expected, "tool_calls")
    one = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert (one.message.content, one.message.tool_calls, one.finish_reason) == (
        HERMES_CALL, None, "stop")


def test_a_tool_round_trip(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none",
                                       **GREEDY)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    rendered = engine.engine.tokenizer.apply_chat_template(
        [*history[:1], {**history[1], "tool_calls": [{**call, "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]],
        tools=TOOLS, chat_template=TOOLS_TEMPLATE_PATH.read_text(), add_generation_prompt=True,
        return_dict=False)
    assert r.usage.prompt_tokens == len(rendered)  # the calls and the result reached the model


@pytest.mark.parametrize("kw, param, message", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools",
     "parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    ({"tools": TOOLS, "functions": [{"name": "f"}]}, "functions", "deprecated"),
])
def test_bad_tool_requests(client: openai.OpenAI, kw: Any, param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(messages=ASK, **GREEDY, **kw)
    error: Any = refused.value.body
    assert error["param"] == param and message in error["message"], error


def test_auto_needs_the_flags(engine: AsyncLLMEngine) -> None:
    with openai_client(engine) as client:  # a gateway started without them
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(messages=ASK, tools=TOOLS, **GREEDY)
        error: Any = refused.value.body
        assert (error["message"], error["param"]) == (AUTO_NEEDS_FLAGS, "tool_choice")
        forced = client.chat.completions.create(messages=ASK, tools=TOOLS,
                                                tool_choice="required", **GREEDY)
        assert calls_of(forced.choices[0].message)


def test_which_template_renders_tools(engine: AsyncLLMEngine) -> None:
    """ChatML that cannot render tools: the shipped template; other templates: refused."""
    tok = engine.engine.tokenizer
    shipped = TOOLS_TEMPLATE_PATH.read_text()
    ids = ChatRenderer(tok).render(ASK, tools=TOOLS)
    assert ids == tok.apply_chat_template(ASK, tools=TOOLS, chat_template=shipped,
                                          add_generation_prompt=True, return_dict=False)
    assert ChatRenderer(tok).render(ASK) == tok.apply_chat_template(
        ASK, add_generation_prompt=True, return_dict=False)  # no tools: the model's own
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=CANNOT_RENDER_TOOLS + ".*--chat-template"):
        ChatRenderer(tok, plain).render(ASK, tools=TOOLS)
    own = "{{ tools | length }} tools: {{ messages[0]['content'] }}"  # renders tools itself
    assert tok.decode(ChatRenderer(tok, own).render(ASK, tools=TOOLS)) == (
        "2 tools: " + ASK[0]["content"])
