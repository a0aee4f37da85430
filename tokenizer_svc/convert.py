"""Tokenizer service edge: its protobuf messages <-> plain Python objects."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from protos import tokenizer_pb2

if TYPE_CHECKING:
    from tokenizer_svc.service import TokenizerModel


def messages_from_pb(messages: Iterable[tokenizer_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI-shaped message dicts: role and content, and name, tool_call_id and tool_calls
    where set. ValueError for tool calls that are not a JSON list."""
    return [_message_from_pb(m) for m in messages]


def _message_from_pb(m: tokenizer_pb2.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    for name in ("name", "tool_call_id"):
        if m.HasField(name):
            message[name] = getattr(m, name)
    if m.tool_calls_json:
        message["tool_calls"] = _json_list(m.tool_calls_json, "tool_calls_json")
    return message


def tools_from_pb(tools_json: str) -> list[dict[str, Any]] | None:
    """The request's tools (None for ""); ValueError unless a JSON list."""
    return _json_list(tools_json, "tools_json") if tools_json else None


def _json_list(text: str, field: str) -> list[Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError of odd bytes
        raise ValueError(f"{field} is not JSON: {exc}") from None
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a JSON list, got {type(value).__name__}")
    return value


def model_info_to_pb(model: TokenizerModel) -> tokenizer_pb2.ModelInfo:
    """The model's facts, with the tokenizer serialized so callers can rebuild it locally."""
    tok = model.tokenizer
    special = {
        name: getattr(tok, name)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tok, name, None) is not None
    }
    special["additional_special_tokens"] = list(getattr(tok, "additional_special_tokens", []))
    special["chat_template"] = tok.chat_template
    return tokenizer_pb2.ModelInfo(
        model_name=model.model_name,
        eos_token_ids=model.eos_token_ids,
        max_model_len=model.max_model_len,
        has_chat_template=model.chat.has_template,
        vocab_size=model.vocab_size,
        tokenizer_json=tok.backend_tokenizer.to_str(),
        tokenizer_config_json=json.dumps(special),
    )
