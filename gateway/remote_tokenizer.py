"""The tokenizer service seen from the gateway: the model's facts, a local copy of its tokenizer
(the gateway detokenizes incrementally), and tokenization and chat templates over gRPC: each a
message on one TokenizeStreams call kept open (tokenizer_svc/service.py says why), or a call of
its own where the service has no such call (an earlier version) or `shared` is off."""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

import grpc

from gateway.backend import BackendError, ModelFacts
from gateway.shared_call import AnsweredCall, status_from_wire
from pdserve.cluster.grpc_server import check_health, open_channel
from pdserve.cluster.tls import PLAINTEXT, TLSConfig
from protos import tokenizer_pb2, tokenizer_pb2_grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
TIMEOUT_S = 30.0  # per call
logger = logging.getLogger(__name__)


class TokenizeStreamsCall(AnsweredCall):
    """One TokenizeStreams call: each call's answer found by its call id."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        super().__init__(stub.TokenizeStreams(), "the tokenizer service")

    def route(self, reply: tokenizer_pb2.TokenizeStreamsReply) -> None:
        for a in reply.answers:
            if a.WhichOneof("answer") == "response":
                self.answer(a.call_id, a.response)
            else:
                self.answer(a.call_id, error=status_from_wire(a.error_code, a.error_message))


class RemoteTokenizer:
    """One channel to the tokenizer service at `address`; `start()` before anything else."""

    def __init__(self, address: str, tls: TLSConfig = PLAINTEXT, shared: bool = True) -> None:
        self.address, self.tls = address, tls
        self.facts: ModelFacts | None = None
        self.tokenizer: Any = None  # a local HF tokenizer, once started
        self._channel: grpc.aio.Channel | None = None
        self.shared = shared  # Tokenize and ApplyChatTemplate on one TokenizeStreams call
        self._streams: TokenizeStreamsCall | None = None
        self._call_ids = itertools.count(1)

    async def start(self) -> ModelFacts:
        """Fetch the model's facts and tokenizer (once; later calls return them)."""
        if self.facts is None:
            info = await self._stub().GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=30)
            self.tokenizer = tokenizer_from_info(info)
            self.facts = ModelFacts(
                model_name=info.model_name, eos_token_ids=frozenset(info.eos_token_ids),
                max_model_len=info.max_model_len, has_chat_template=info.has_chat_template,
                vocab_size=info.vocab_size,
            )
        return self.facts

    async def healthy(self) -> bool:
        return await check_health(self.address, tls=self.tls)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._call("tokenize", request)).token_ids)

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        request = tokenizer_pb2.ChatTemplateRequest(
            messages=[_message_to_pb(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools_json=json.dumps(tools) if tools else "",
        )
        if chat_template is not None:
            request.chat_template = chat_template
        return list((await self._call("chat_template", request)).token_ids)

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def _call(self, kind: str, request: Any) -> Any:
        """The `kind` call ("tokenize" or "chat_template") of `request`: INVALID_ARGUMENT raises
        ValueError, other failures BackendError."""
        try:
            return await self._ask(kind, request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from exc
            raise BackendError(f"tokenizer service: {exc.details()}",
                               retryable=exc.code() in RETRYABLE) from exc

    async def _ask(self, kind: str, request: Any) -> Any:
        if self.shared:
            streams = self._streams
            if streams is None or streams.failed:
                streams = self._streams = TokenizeStreamsCall(self._stub())
            call = tokenizer_pb2.TokenizeCall(call_id=next(self._call_ids), **{kind: request})
            try:
                return await streams.ask(call.call_id,
                                         tokenizer_pb2.TokenizeStreamsRequest(calls=[call]),
                                         TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if not streams.unserved(exc):
                    raise
                logger.info("the tokenizer service serves no TokenizeStreams (an earlier "
                            "version): a call per request")
                self.shared = False  # nothing reached the service: ask it alone
        stub = self._stub()
        method = stub.Tokenize if kind == "tokenize" else stub.ApplyChatTemplate
        return await method(request, timeout=TIMEOUT_S)

    def _stub(self) -> tokenizer_pb2_grpc.TokenizerStub:
        if self._channel is None:
            self._channel = open_channel(self.address, self.tls)
        return tokenizer_pb2_grpc.TokenizerStub(self._channel)


def _message_to_pb(message: dict[str, Any]) -> tokenizer_pb2.ChatMessage:
    calls = message.get("tool_calls")
    return tokenizer_pb2.ChatMessage(
        role=message["role"], content=message["content"], name=message.get("name"),
        tool_call_id=message.get("tool_call_id"),
        tool_calls_json=json.dumps(calls) if calls else "",
    )


def tokenizer_from_info(info: tokenizer_pb2.ModelInfo) -> Any:
    """A local fast tokenizer rebuilt from the tokenizer service's serialized one."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    config = {k: v for k, v in json.loads(info.tokenizer_config_json).items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(info.tokenizer_json),
                                   **config)
