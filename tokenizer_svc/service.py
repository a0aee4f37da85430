"""The Tokenizer gRPC servicer: thin — decode the message, call the HF tokenizer, encode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from pdserve.cluster.call_streams import CallStreams, status_to_wire
from protos import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_template import ChatRenderer
from tokenizer_svc.convert import messages_from_pb, model_info_to_pb, tools_from_pb


class TokenizerModel:
    """The served model's tokenizer and facts, loaded once; `chat_template` (the text of
    --chat-template) replaces the model's own template."""

    def __init__(self, model_path: str, model_name: str, max_model_len: int | None = None,
                 chat_template: str | None = None):
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
        self.chat = ChatRenderer(self.tokenizer, chat_template)


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, model: TokenizerModel):
        self.model = model
        # set when the service stops: its TokenizeStreams calls end once idle, refusing more
        self.stopping = asyncio.Event()

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ids = await asyncio.to_thread(
            self.model.tokenizer.encode, request.text, add_special_tokens=request.add_special_tokens
        )
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt=request.text)

    async def ApplyChatTemplate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        messages = messages_from_pb(request.messages)
        template = request.chat_template if request.HasField("chat_template") else None
        ids = await asyncio.to_thread(
            self.model.chat.render, messages, request.add_generation_prompt, template,
            tools_from_pb(request.tools_json),
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

    async def TokenizeStreams(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.TokenizeStreamsReply]:
        streams = TokenizeStreams(self, self.stopping)
        async with aclosing(streams.serve(request_iterator)) as replies:
            async for reply in replies:
                yield reply


class TokenizeStreams(CallStreams):
    """Serves one TokenizeStreams call (pdserve/cluster/call_streams.py): each call runs as
    its own Tokenize or ApplyChatTemplate would, in a task of its own.

    NOTE: why. From an idle service a new unary call passes gRPC core's threads, each woken
    from sleep, before its handler runs: about twice a message's way on a call kept open
    (`python -m pdserve.bench.grpc_ping`), and a text or chat prompt's tokenization is on its
    first token's way. So a gateway keeps one call open and sends each as a message on it."""

    def __init__(self, servicer: TokenizerServicer, stopping: asyncio.Event) -> None:
        super().__init__(lambda: not stopping.is_set(), stopping)
        self.servicer = servicer

    async def handle(self, request: tokenizer_pb2.TokenizeStreamsRequest) -> None:
        for call in request.calls:
            if self.admitting():
                self.start(str(call.call_id), self._run_call(call))
            else:  # as a call of its own to a stopping server: UNAVAILABLE
                self._fail(tokenizer_pb2.TokenizeAnswer(call_id=call.call_id),
                           ConnectionError("the tokenizer service is stopping"), "call")

    def reply(self, items: list[tokenizer_pb2.TokenizeAnswer]) -> Any:
        return tokenizer_pb2.TokenizeStreamsReply(answers=items)

    async def _run_call(self, call: tokenizer_pb2.TokenizeCall) -> None:
        answer = tokenizer_pb2.TokenizeAnswer(call_id=call.call_id)
        kind = call.WhichOneof("call")
        try:
            if kind == "tokenize":
                response = await self.servicer.Tokenize(call.tokenize, None)
            elif kind == "chat_template":
                response = await self.servicer.ApplyChatTemplate(call.chat_template, None)
            else:
                raise ValueError(f"call {call.call_id}: neither tokenize nor chat_template")
            answer.response.CopyFrom(response)
        except Exception as exc:  # noqa: BLE001 - the status its own call would end with
            self._fail(answer, exc, kind or "call")
            return
        self.add(answer)

    def _fail(self, answer: tokenizer_pb2.TokenizeAnswer, exc: BaseException, what: str) -> None:
        answer.error_code, answer.error_message = status_to_wire(
            exc, f"[call {answer.call_id}] {what}")
        self.add(answer)
