"""The OpenAI wire format: pydantic v2 models of `/v1/completions`, `/v1/chat/completions`,
`/v1/models` and the error body, with vLLM's extensions (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, and the
structured-output fields `structured_outputs`, `guided_*`: gateway/structured.py maps them).
Tool calling's own models are gateway/tools/protocol.py's.

Requests accept unknown fields and keep them in `model_extra`: the serving layer answers 400
naming any that asks for something (`serving.check_unknown_fields`; OpenAI too answers 400
"Unrecognized request argument") and logs those whose value asks for nothing.
Range checks live in `SamplingParams`, the one place that knows them; these models check types,
the OpenAI-specific bounds (logprobs 0..20, n up to 128) and the wire's: finite numbers, integers
that fit the workers' protobuf fields, and list lengths that keep one request from fanning out
without end.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from gateway.tools.protocol import ChatTool, DeltaToolCall, ToolCall, ToolChoice

MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's bound on `n`
MAX_STOP = 16  # stop strings (OpenAI allows 4; vLLM has no bound) and, alike, stop token ids
MAX_PROMPTS = 2048  # prompts in one batched completions request
UINT32_MAX = 2**32 - 1  # token ids and counts travel as uint32 to the workers
INT64 = 2**63  # the seed travels as int64
FLOAT32_RANGE = (1.1754943508222875e-38, 3.4028234663852886e38)  # normal float32 magnitudes

TokenCount = Annotated[int, Field(le=UINT32_MAX)]
JsonSchema = dict[str, Any] | str  # a JSON schema: an object, or its JSON text


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- errors ------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk too (with include_usage)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`. `strict` either way: the output always fits the schema."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, serialize_by_alias=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a `json_schema` object')
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` object (its other options are refused, by name)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, serialize_by_alias=True)

    json_: JsonSchema | None = Field(default=None, alias="json")  # `json` would shadow too
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class OpenAIRequest(BaseModel):
    """Fields shared by completions and chat requests."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: TokenCount | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64 - MAX_N)  # sample i: seed + i
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = Field(
        default=None, max_length=MAX_STOP
    )
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: TokenCount = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM: the prompt tokens' logprobs and this many alternatives (not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # at most one output constraint (gateway/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # token controls: OpenAI's logit_bias (token id -> bias), vLLM's allowed_token_ids and
    # bad_words (checked against the vocabulary by the gateway, applied by the engine)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = None
    bad_words: list[str] | None = Field(default=None, max_length=MAX_STOP)

    @field_validator(
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty",
    )
    @classmethod
    def _fits_float32(cls, value: float | None) -> float | None:
        """Sampling numbers travel as float32: 1e-300 would arrive as 0 (a top_p of 0 is
        invalid), 1e300 as inf. Refuse what would change on the way."""
        low, high = FLOAT32_RANGE
        if value and not low <= abs(value) <= high:
            raise ValueError(f"must be 0 or between {low:.2g} and {high:.2g} in magnitude")
        return value

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stop)}")
        return stop

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: TokenCount | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _bounded_batch(cls, prompt: Any) -> Any:
        batched = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if batched and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed, got {len(prompt)}")
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (its content may be null)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A readable refusal of parts a text-only model cannot take (images, audio, files)."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: "
                                     "pdserve serves text-only models (send text parts)")
        return content
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    # tool calling (gateway/tools/): tool_choice defaults to "auto" with tools, else "none"
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true


# ---- responses ---------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int | None = None) -> UsageInfo:
        details = None if cached_tokens is None else PromptTokensDetails(
            cached_tokens=cached_tokens)
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class PromptLogprob(BaseModel):
    """vLLM's Logprob as served: one alternative at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: None for the first prompt token, then {token id: PromptLogprob}
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class _StreamChunk(BaseModel):
    """A streamed chunk: `usage` appears only on the final usage chunk."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _omit_empty_usage(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("usage") is None:
            data.pop("usage", None)
        return data


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for (left out if not)

    @model_serializer(mode="wrap")
    def _omit_no_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_StreamChunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """`content` is null when the assistant only called tools; `tool_calls` is left out when
    it called none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for (left out if not)

    @model_serializer(mode="wrap")
    def _omit_no_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler(self), "prompt_logprobs")


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_StreamChunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


def _without_none(data: dict[str, Any], key: str) -> dict[str, Any]:
    if data.get(key) is None:
        data.pop(key, None)
    return data


# ---- models ------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str
    parent: str | None = None  # a LoRA adapter's base model; None for the base model itself
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter at `lora_path` (a folder
    every worker can read) as model `lora_name`."""

    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's); vLLM's `lora_int_id` is accepted and unused."""

    lora_name: str | None = None
    lora_int_id: int | None = None
