"""One choice's output read back as content and tool calls, whole or as it streams, in
OpenAI's shape. Each choice of `n` is read on its own."""

from __future__ import annotations

from gateway.protocol import DeltaMessage
from gateway.tools.choice import parse_constrained
from gateway.tools.parsers import (
    StreamingToolParser,
    ToolCall,
    ToolDelta,
    call_deltas,
    get_parser,
)
from gateway.tools.plan import ToolPlan
from gateway.tools.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall
from gateway.tools.protocol import ToolCall as WireToolCall


def read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: a constrained one is all calls (or, cut short and
    unparsable, all content); an "auto" one is split by the parser."""
    if plan.constrained:
        calls = parse_constrained(text, plan.choice)
        return (None, calls) if calls else (text, [])
    if plan.parser is None:
        return text, []
    content, calls = get_parser(plan.parser).extract(text)
    return content, calls if plan.parallel else calls[:1]


class CallStream:
    """One choice's streamed output -> deltas of content and calls. "auto": as the streaming
    parser finds them; constrained: the calls at the end (the JSON is no content)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.called = False  # a call has gone out
        auto = plan.parser is not None and not plan.constrained
        self.parser = StreamingToolParser(get_parser(plan.parser)) if auto else None

    def feed(self, text: str, final: bool) -> list[ToolDelta]:
        """The deltas that the output's next `text` adds (`final`: its last)."""
        self.text += text
        if self.parser is not None:
            deltas = self.parser.feed(self.text, final)
            if not self.plan.parallel:
                deltas = [d for d in deltas if d.index in (None, 0)]
        elif not final:
            deltas = []
        else:
            content, calls = read_calls(self.plan, self.text)
            deltas = [ToolDelta(content=content)] if content else []
            deltas += [d for i, call in enumerate(calls) for d in call_deltas(i, call)]
        self.called = self.called or any(d.index is not None for d in deltas)
        return deltas


def finish_reason(reason: str | None, called: bool) -> str | None:
    """"tool_calls" for an output that made calls and ended by itself (not cut by length)."""
    return "tool_calls" if called and reason == "stop" else reason


def wire_call(call: ToolCall) -> WireToolCall:
    return WireToolCall(id=call.id, function=FunctionCall(name=call.name,
                                                          arguments=call.arguments))


def delta_message(d: ToolDelta) -> DeltaMessage:
    if d.index is None:
        return DeltaMessage(content=d.content)
    call = DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
    return DeltaMessage(tool_calls=[call])
