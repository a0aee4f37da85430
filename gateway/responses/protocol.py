"""The OpenAI Responses API's wire format (`POST /v1/responses`): the request pdserve serves and
the response object with its output items. Streamed events are built in gateway/responses/
events.py. Unknown request fields land in `model_extra` and are refused by name unless they ask
for nothing (gateway/serving.py: `check_unknown_fields`), as on the chat route."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocol import MAX_STOP, TokenCount
from gateway.tools.protocol import FUNCTION_NAME


# ---- request -----------------------------------------------------------------------------
class FunctionTool(BaseModel):
    """A function tool, as the Responses API spells it (flat: no nested `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or a JSON schema (`name`, `schema`)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat = TextFormat()


class ResponsesRequest(BaseModel):
    """What `POST /v1/responses` takes. `input`: a string (one user message) or a list of
    items: messages ({role, content}), the model's earlier `function_call`s and their
    `function_call_output`s (gateway/responses/convert.py reads them)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    # vLLM's sampling extensions, as on the other routes
    top_k: TokenCount | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# ---- response ----------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """The response: the request's settings echoed, its output items, its usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: Any = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    store: bool = True
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
