"""Tool-call parsers: a model's text -> (content, tool calls), whole or streamed.

    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>, one block per call
                  (Hermes, Qwen2.5); a block holding a JSON list of calls is SmolLM2-Instruct's
                  form, so `smollm2` is the same parser
    llama3_json   {"name": "f", "parameters": {...}} (after an optional <|python_tag|>), calls
                  separated by ";" (Llama 3.1/3.2's JSON tool calling)

Streaming (`StreamingToolParser`): the text outside tool calls goes out as content at once; a
call goes out when its block is complete, as vLLM's deltas do it: first its index, id, type and
name (arguments ""), then the arguments text in pieces. Text that may be the start of a marker
is held back until it is known not to be.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

ARG_PIECE = 16  # characters of arguments per streamed delta


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def make_call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """A call from a parsed {"name", "arguments"} object (None if it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models put the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the first call or None, the calls); the text as content when no
        block parses."""
        if self.start not in text:
            return text, []
        calls = [c for body in self._block.findall(text) for c in self.calls_in(body)]
        if not calls:
            return text, []
        content = text[: text.index(self.start)].strip()
        return content or None, calls

    def calls_in(self, body: str) -> list[ToolCall]:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return []
        items = obj if isinstance(obj, list) else [obj]
        calls = [make_call(item) for item in items]
        return [c for c in calls if c is not None] if all(calls) else []


class Llama3JsonParser:
    start, end = "", ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_objects(body):
            try:
                call = make_call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return None, calls


def _split_objects(body: str) -> list[str]:
    """`{...}; {...}` -> the objects' texts (a ";" inside a string does not split)."""
    parts, depth, in_str, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(body):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return [p for p in parts if p]


PARSERS: dict[str, type] = {
    "hermes": HermesParser, "smollm2": HermesParser, "llama3_json": Llama3JsonParser,
}


def get_parser(name: str) -> HermesParser | Llama3JsonParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (one of {', '.join(PARSERS)})")
    return PARSERS[name]()


@dataclass
class ToolDelta:
    """One streamed piece: content text, or a piece of tool call `index`."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class StreamingToolParser:
    """Feed the cumulative text; get the deltas it adds (see the module docstring)."""

    def __init__(self, parser: HermesParser | Llama3JsonParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of the text handled
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> list[ToolDelta]:
        if isinstance(self.parser, Llama3JsonParser):
            return self._feed_whole(text, final)
        out: list[ToolDelta] = []
        start, end = self.parser.start, self.parser.end
        while True:
            rest = text[self.sent:]
            i = rest.find(start)
            if i < 0:
                keep = 0 if final else _partial_suffix(rest, start)
                if len(rest) - keep > 0 and not self.calls:
                    out.append(ToolDelta(content=rest[: len(rest) - keep]))
                self.sent += len(rest) - keep
                return out
            if i and not self.calls:
                out.append(ToolDelta(content=rest[:i]))
            j = rest.find(end, i)
            if j < 0 and not final:
                self.sent += i
                return out
            body = rest[i + len(start): j if j >= 0 else len(rest)]
            for call in self.parser.calls_in(body):
                out += self._call_deltas(call)
            self.sent += (j + len(end)) if j >= 0 else len(rest)

    def _feed_whole(self, text: str, final: bool) -> list[ToolDelta]:
        """llama3_json: a call is only known when the whole output is (it may be content)."""
        if not final:
            return []
        content, calls = self.parser.extract(text)
        out = [ToolDelta(content=content)] if content else []
        for call in calls:
            out += self._call_deltas(call)
        self.sent = len(text)
        return out

    def _call_deltas(self, call: ToolCall) -> list[ToolDelta]:
        self.calls.append(call)
        return call_deltas(len(self.calls) - 1, call)


def call_deltas(index: int, call: ToolCall) -> list[ToolDelta]:
    """Call `index` streamed: its id and name (arguments ""), then its arguments in pieces."""
    out = [ToolDelta(index=index, id=call.id, name=call.name, arguments="")]
    args = call.arguments
    out += [ToolDelta(index=index, arguments=args[k:k + ARG_PIECE])
            for k in range(0, len(args), ARG_PIECE)]
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may grow into it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
