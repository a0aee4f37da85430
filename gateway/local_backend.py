"""The colocated backend: an in-process `AsyncLLMEngine` behind the gateway (vLLM's
api_server shape). The engine runs prefill and decode in one batch; no network in between."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, Logprob, prompt_logprob_entries
from engine.sampling_params import RequestOutputKind, SamplingParams
from gateway.backend import (
    BackendError,
    ModelFacts,
    RequestRejected,
    TokenDelta,
    TokenLogprobs,
)
from tokenizer_svc.chat_template import ChatRenderer


class LocalBackend:
    """`Backend` over an `AsyncLLMEngine` in this process. Conversations are rendered here, as
    the tokenizer service would (`chat_template`: the text of --chat-template)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self._chat: ChatRenderer | None = None
        self._facts: ModelFacts | None = None

    @property
    def chat(self) -> ChatRenderer:
        if self._chat is None:
            self._chat = ChatRenderer(self.get_tokenizer(), self.chat_template)
        return self._chat

    async def model_info(self) -> ModelFacts:
        if self._facts is None:
            core = self.engine.engine
            self._facts = ModelFacts(
                model_name=self.model_name,
                eos_token_ids=frozenset(core.eos_token_ids),
                max_model_len=core.max_model_len,
                has_chat_template=self.chat.has_template,
                vocab_size=core.vocab_size,
            )
        return self._facts

    def get_tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.get_tokenizer()
        return await asyncio.to_thread(
            tokenizer.encode, text, add_special_tokens=add_special_tokens
        )

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return await asyncio.to_thread(
            self.chat.render, messages, add_generation_prompt, chat_template, tools
        )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prior_output_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """Token deltas of one sequence from the engine, after `prior_output_token_ids` when
        given, under the LoRA adapter `lora_request` (loaded on demand; None: the base model).
        Closing this generator closes the engine's stream, which aborts the request and frees
        its KV blocks."""
        engine_params = params.clone(
            n=1, output_kind=RequestOutputKind.DELTA, detokenize=False, stop=None,
            include_stop_str_in_output=False,
        )
        stream = self.engine.generate(list(prompt_token_ids), engine_params, request_id,
                                      prior_output_token_ids=prior_output_token_ids,
                                      lora_request=lora_request)
        first = True
        try:
            async for out in stream:
                delta = _to_delta(out.outputs[0])
                if first:
                    delta.num_cached_tokens, first = out.num_cached_tokens, False
                if out.prompt_logprobs is not None:  # once, with the first token
                    delta.prompt_logprobs = prompt_logprob_entries(
                        prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs or 0)
                yield delta
        except EngineDeadError as exc:
            raise BackendError(f"the engine has failed: {exc.__cause__ or exc}") from exc
        except ValueError as exc:  # what the gateway cannot check: a grammar that won't compile
            raise RequestRejected(str(exc)) from exc
        finally:
            await stream.aclose()

    async def workers(self) -> list[dict[str, Any]]:
        """The one in-process engine, as a worker of role "colocated"."""
        s = await self.engine.stats()
        return [{
            "worker_id": "colocated", "role": "colocated", "address": "in-process",
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_free_blocks": s.num_free_blocks, "num_total_blocks": s.num_total_blocks,
            "num_cached_blocks": s.num_cached_blocks,
            "lora_adapters": [r.lora_name for r in self.engine.list_loras()],
        }]

    async def ready(self) -> bool:
        """True while the engine thread runs."""
        return self.engine.is_running

    async def close(self) -> None:
        """Stop the engine thread (requests in flight are abandoned)."""
        await asyncio.to_thread(self.engine.shutdown)


def _to_delta(out: CompletionOutput) -> TokenDelta:
    logprobs = None
    if out.logprobs is not None:
        logprobs = [_to_token_logprobs(tid, lp) for tid, lp in zip(out.token_ids, out.logprobs)]
    stop_reason = out.stop_reason if isinstance(out.stop_reason, int) else None
    return TokenDelta(list(out.token_ids), logprobs, out.finish_reason, stop_reason)


def _to_token_logprobs(token_id: int, step: dict[int, Logprob]) -> TokenLogprobs:
    """{id: Logprob(logprob, rank)} (the chosen token always present, ranked or not) ->
    (chosen logprob, {top-k id: logprob})."""
    top = {tid: lp.logprob for tid, lp in step.items() if lp.rank is not None}
    return step[token_id].logprob, top

