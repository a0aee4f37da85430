"""Tokenizer service edge: its protobuf messages <-> plain Python objects."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from protos import tokenizer_pb2

if TYPE_CHECKING:
    from tokenizer_svc.service import TokenizerModel


def messages_from_pb(messages: Iterable[tokenizer_pb2.ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


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
        has_chat_template=bool(tok.chat_template),
        vocab_size=model.vocab_size,
        tokenizer_json=tok.backend_tokenizer.to_str(),
        tokenizer_config_json=json.dumps(special),
    )
