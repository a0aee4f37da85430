"""vLLM's tokenizer routes beside the OpenAI ones: POST /tokenize (a prompt, or a conversation
through the chat template, as a generation request would see it), POST /detokenize, and the
shapes of their bodies.

Ids come from the backend, as generation gets them (the tokenizer service, or the colocated
engine's tokenizer); text and token strings from the gateway's local copy of the tokenizer, the
one that detokenizes streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.chat import render_chat
from gateway.errors import OpenAIError
from gateway.protocol import ChatMessage
from gateway.serving import ServingContext
from gateway.tools.protocol import ChatTool


class TokenizeCompletionRequest(BaseModel):
    """A prompt to tokenize as /v1/completions would."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str = Field(min_length=1)
    add_special_tokens: bool = True  # the tokenizer's own (a BOS), as completions adds them
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """A conversation to tokenize as /v1/chat/completions would."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # on top of the template's: vLLM encodes its text again
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool | None = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # the vocabulary's strings, with return_token_strs


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def tokenize_model(body: Any) -> type[TokenizeRequest]:
    """Which shape a /tokenize body has: a conversation when it gives messages."""
    is_chat = isinstance(body, dict) and "messages" in body
    return TokenizeChatRequest if is_chat else TokenizeCompletionRequest


class TokenizeServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """The ids a generation request with this prompt (or conversation) would get. 404 for
        another model's name, 400 naming the field for what cannot be tokenized."""
        await self.ctx.check_model(req.model)
        facts = await self.ctx.backend.model_info()
        if isinstance(req, TokenizeChatRequest):
            ids = await self._render(req)
        else:
            ids = await self._tokenize(req.prompt, req.add_special_tokens, "prompt")
        strs = None
        if req.return_token_strs:
            strs = self.ctx.backend.get_tokenizer().convert_ids_to_tokens(ids)
        return TokenizeResponse(count=len(ids), max_model_len=facts.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of `req.tokens`, special tokens included (vLLM's). 400 naming `tokens`
        for an id outside the vocabulary."""
        await self.ctx.check_model(req.model)
        vocab_size = (await self.ctx.backend.model_info()).vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"Token id {bad} is out of vocabulary (size {vocab_size}).",
                              param="tokens")
        text = await asyncio.to_thread(self.ctx.backend.get_tokenizer().decode, req.tokens)
        return DetokenizeResponse(prompt=text)

    async def _render(self, req: TokenizeChatRequest) -> list[int]:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
        ids = await render_chat(self.ctx.backend, req.messages, req.add_generation_prompt,
                                req.chat_template, tools)
        if not req.add_special_tokens:
            return ids
        # vLLM renders the conversation as text and encodes that with the special tokens
        text = self.ctx.backend.get_tokenizer().decode(ids, clean_up_tokenization_spaces=False)
        return await self._tokenize(text, True, "messages")

    async def _tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return await self.ctx.backend.tokenize(text, add_special_tokens)
        except ValueError as exc:  # the tokenizer service's INVALID_ARGUMENT
            raise OpenAIError(f"Cannot tokenize the {param}: {exc}", param=param) from exc
