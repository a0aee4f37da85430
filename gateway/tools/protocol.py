"""The OpenAI wire format of tool calling: the request's `tools`, `tool_choice` and the
messages' calls (gateway/protocol.py's ChatCompletionRequest holds them), and the calls of a
response, whole or as stream deltas."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

FUNCTION_NAME = r"^[a-zA-Z0-9_.:-]{1,64}$"  # OpenAI's, plus "." and ":" (namespaced names)


# ---- requests ----------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    """A call an assistant made: in a response, or in a request's history."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        """The call as chat templates read it: its arguments an object where they parse as
        one (vLLM's way; templates such as Qwen's `tojson` them)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": self.type, "function": function}


# ---- stream deltas -----------------------------------------------------------------------
class _OmitNone(BaseModel):
    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    """A piece of call `index`: its first carries id, type and name (arguments ""), the
    next ones pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
