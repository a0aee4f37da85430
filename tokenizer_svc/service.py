"""The Tokenizer gRPC servicer: thin — decode the message, call the HF tokenizer, encode."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from protos import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.convert import messages_from_pb, model_info_to_pb


class TokenizerModel:
    """The served model's tokenizer and facts, loaded once."""

    def __init__(self, model_path: str, model_name: str, max_model_len: int | None = None):
        from engine.model_loader import load_hf_config, load_tokenizer
        from engine.request_checks import eos_token_ids

        self.tokenizer = load_tokenizer(model_path)
        config = load_hf_config(model_path)
        context = getattr(config, "max_position_embeddings", 2048)
        if max_model_len is not None and max_model_len > context:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context {context}")
        self.model_name = model_name
        self.max_model_len = max_model_len or context
        self.eos_token_ids = sorted(eos_token_ids(config, self.tokenizer))
        self.vocab_size = config.vocab_size

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                 chat_template: str | None) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty")
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("the model has no chat template")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=chat_template, return_dict=False,
            )
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors of a bad template or a role it rejects:
            raise ValueError(str(exc)) from exc  # the caller's mistake (INVALID_ARGUMENT)
        return list(ids)


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, model: TokenizerModel):
        self.model = model

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ids = await asyncio.to_thread(
            self.model.tokenizer.encode, request.text, add_special_tokens=request.add_special_tokens
        )
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt=request.text)

    async def ApplyChatTemplate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        messages = messages_from_pb(request.messages)
        template = request.chat_template if request.HasField("chat_template") else None
        ids = await asyncio.to_thread(
            self.model.chat_ids, messages, request.add_generation_prompt, template
        )
        prompt = self.model.tokenizer.decode(ids)
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt=prompt)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        vocab = self.model.vocab_size
        bad = [t for t in request.token_ids if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary ({vocab})")
        text = self.model.tokenizer.decode(
            list(request.token_ids), skip_special_tokens=request.skip_special_tokens
        )
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return model_info_to_pb(self.model)
