"""`tool_choice` "required" and a named function, enforced by a grammar (vLLM's way): the output
is then plain JSON, not the model's own tool-call format, and always parses.

    required   [{"name": <one of the tools>, "arguments": <that tool's parameters>}, ...]
               (one item at most when parallel_tool_calls is false)
    named      <the named function's parameters>: the arguments object itself
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured.params import StructuredOutputsParams
from gateway.tools.parsers import ToolCall

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    items = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constraint(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool
) -> StructuredOutputsParams | None:
    """The grammar for this tool_choice, or None ("auto" and "none" are not constrained)."""
    if tool_choice == "required":
        return StructuredOutputsParams(json=required_schema(tools, parallel))
    if isinstance(tool_choice, dict):
        return StructuredOutputsParams(json=_parameters(named_tool(tools, tool_choice)))
    return None


def named_tool(tools: list[dict[str, Any]], tool_choice: dict[str, Any]) -> dict[str, Any]:
    name = tool_choice["function"]["name"]
    for t in tools:
        if t["function"]["name"] == name:
            return t
    raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")


def parse_constrained(text: str, tool_choice: str | dict[str, Any]) -> list[ToolCall]:
    """The calls of a constrained output (empty if it was cut short and does not parse)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]
