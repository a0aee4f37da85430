"""Tool-call parsers (gateway/tools/): whole outputs, streamed outputs assembling to the same
calls, tool_choice grammars, and the shipped ChatML tool template."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from gateway.tools.choice import constraint, parse_constrained, required_schema
from gateway.tools.parsers import StreamingToolParser, get_parser

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
SMOLLM2 = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris; France"}}, '
           '{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris; France"}}; '
         '{"name": "add", "parameters": {"a": 1, "b": 2}}')
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
]


@pytest.mark.parametrize("parser,text,content,city", [
    ("hermes", HERMES, "Let me check.", "Paris"),
    ("smollm2", SMOLLM2, None, "Paris; France"),
    ("llama3_json", LLAMA, None, "Paris; France"),
])
def test_whole_outputs_parse_to_calls(parser, text, content, city):
    got_content, calls = get_parser(parser).extract(text)
    assert got_content == content
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": city}
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2}
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_text_without_calls_is_content(parser):
    for text in ("The weather is fine.", "<tool_call>not json</tool_call>", "{not a call}"):
        assert get_parser(parser).extract(text) == (text, [])


@pytest.mark.parametrize("parser,text", [("hermes", HERMES), ("smollm2", SMOLLM2),
                                         ("llama3_json", LLAMA)])
@pytest.mark.parametrize("step", [1, 3, 50])
def test_streamed_deltas_assemble_to_the_whole_parse(parser, text, step):
    stream = StreamingToolParser(get_parser(parser))
    deltas = []
    for end in range(step, len(text) + step, step):
        deltas += stream.feed(text[:end], final=end >= len(text))
    content = "".join(d.content for d in deltas if d.content)
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.index not in calls:  # the first delta of a call carries its id and name
            assert d.id and d.name and d.arguments == ""
            calls[d.index] = {"name": d.name, "arguments": ""}
        calls[d.index]["arguments"] += d.arguments or ""
    whole_content, whole = get_parser(parser).extract(text)
    assert content.strip() == (whole_content or "")
    assert "<tool_call" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.name, json.loads(c.arguments)) for c in whole]


def test_required_and_named_tool_choice_constraints():
    schema = required_schema(TOOLS, parallel=True)
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"a": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert json.loads(constraint(TOOLS, named, True).spec()) == TOOLS[0]["function"]["parameters"]
    assert constraint(TOOLS, "auto", True) is None and constraint(TOOLS, "none", True) is None
    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        constraint(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    (call,) = parse_constrained('{"city": "Oslo"}', named)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    calls = parse_constrained('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


def test_chatml_tool_template_round_trips_through_the_hermes_parser(bundled_tokenizer):
    template = (Path(__file__).parent.parent / "tokenizer_svc/templates/chatml_tools.jinja"
                ).read_text()
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    text = bundled_tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=template,
                                                 tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text
    assert "<tool_response>\n18C\n</tool_response>" in text
    assistant_turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    _, calls = get_parser("hermes").extract(assistant_turn)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                    {"city": "Paris"})]
    plain = [{"role": "user", "content": "hi"}]
    assert bundled_tokenizer.apply_chat_template(plain, chat_template=template, tokenize=False) \
        == bundled_tokenizer.apply_chat_template(plain, tokenize=False)
