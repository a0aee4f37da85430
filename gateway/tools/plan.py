"""What a chat request's tool calling does, checked against the gateway's settings.

    tool_choice   default        output                         read back with
    "none"        (no tools)     free                           nothing: all content
    "auto"        (tools given)  free                           --tool-call-parser (parsers.py)
    "required"                   JSON list of calls (grammar)   choice.parse_constrained
    named                        the arguments object (grammar) choice.parse_constrained

"auto" needs the gateway started with --enable-auto-tool-choice and --tool-call-parser (vLLM's
flags and message); a grammar-enforced choice cannot be combined with another output constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.structured.params import StructuredOutputsParams
from gateway.errors import OpenAIError
from gateway.protocol import ChatCompletionRequest
from gateway.structured import constraint_fields
from gateway.tools.choice import constraint, named_tool
from gateway.tools.parsers import get_parser

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")


@dataclass(frozen=True)
class ToolCallConfig:
    """The gateway's --enable-auto-tool-choice and --tool-call-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_parser(self.tool_call_parser)  # ValueError naming the parsers there are
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def auto_parser(self) -> str | None:
        """The parser of "auto" tool choice; None where it is not enabled."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # the request's tools as JSON: what the chat template renders
    choice: str | dict[str, Any]  # "none" | "auto" | "required" | the named function's choice
    parallel: bool  # false: one call at most
    parser: str | None = None  # "auto": the parser that reads the calls

    @property
    def constrained(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, dict)

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of a required or named choice, else None."""
        return constraint(self.tools, self.choice, self.parallel)


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """The request's tool calling (None: it gives no tools), with `parser` the gateway's for
    "auto" (None: not enabled). OpenAIError (400) for a required or named choice without
    tools, a named function that is not among them, "auto" where it is not enabled, and a
    grammar-enforced choice beside another output constraint."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    choice = choice.model_dump() if choice is not None and not isinstance(choice, str) else choice
    if not tools:
        if choice in (None, "none", "auto"):
            return None
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    plan = ToolPlan(tools, choice or "auto", req.parallel_tool_calls is not False,
                    parser if choice in (None, "auto") else None)
    if isinstance(plan.choice, dict):
        try:
            named_tool(tools, plan.choice)
        except ValueError as exc:
            raise OpenAIError(f"{exc}.", param="tool_choice") from None
    if plan.choice == "auto" and parser is None:
        raise OpenAIError(AUTO_NEEDS_FLAGS, param="tool_choice")
    others = constraint_fields(req)
    if plan.constrained and others:
        raise OpenAIError(f"tool_choice {_describe(plan.choice)} constrains the output: it "
                          f"cannot be combined with {', '.join(others)}.", param="tool_choice")
    return plan


def _describe(choice: str | dict[str, Any]) -> str:
    return f'"{choice}"' if isinstance(choice, str) else "naming a function"
