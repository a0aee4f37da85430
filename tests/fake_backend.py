"""A `Backend` without an engine, for tests of the gateway's HTTP layer (bad input, fuzzing).

It tokenizes with a real HF tokenizer and "generates" by repeating the prompt, at most 3 tokens.
Every generation first goes through the gRPC edge as `RemoteBackend` sends it and a worker reads
it (sampling params to protobuf and back), so a request the gateway admits but a worker could
not take fails here as it would in a cluster.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from engine.sampling_params import SamplingParams
from gateway.backend import ModelFacts, TokenDelta
from pdserve.cluster.convert import sampling_params_from_pb, sampling_params_to_pb
from protos import decode_pb2
from tokenizer_svc.chat_template import ChatRenderer

MAX_GENERATED = 3


class FakeBackend:
    def __init__(self, tokenizer: Any, name: str = "fake", max_model_len: int = 128) -> None:
        self.tokenizer = tokenizer
        self.chat = ChatRenderer(tokenizer)
        self.facts = ModelFacts(
            model_name=name, eos_token_ids=frozenset({tokenizer.eos_token_id}),
            max_model_len=max_model_len, has_chat_template=bool(tokenizer.chat_template),
            vocab_size=len(tokenizer),
        )
        self.generated = 0  # generations started
        self.params: list[SamplingParams] = []  # of each generation, as a worker read them

    async def model_info(self) -> ModelFacts:
        return self.facts

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """As the tokenizer service renders (its ValueError: INVALID_ARGUMENT)."""
        return self.chat.render(messages, add_generation_prompt, chat_template, tools)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[TokenDelta, None]:
        self.generated += 1
        request = decode_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            params=sampling_params_to_pb(params, params.max_tokens or 1),
        )
        received = decode_pb2.GenerateRequest.FromString(request.SerializeToString())
        worker = sampling_params_from_pb(received.params)
        self.params.append(worker)
        count = min(worker.max_tokens or 1, MAX_GENERATED)
        for i in range(count):
            token = prompt_token_ids[i % len(prompt_token_ids)]
            logprobs = None if worker.logprobs is None else [(-0.5, {token: -0.5})]
            last = i == count - 1
            reason = ("length" if count == worker.max_tokens else "stop") if last else None
            yield TokenDelta([token], logprobs, reason)

    async def ready(self) -> bool:
        return True

    async def workers(self) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None:
        return None
