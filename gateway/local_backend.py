"""The colocated backend: an in-process `AsyncLLMEngine` behind the gateway (vLLM's
api_server shape). The engine runs prefill and decode in one batch; no network in between."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.outputs import CompletionOutput, Logprob
from engine.sampling_params import RequestOutputKind, SamplingParams
from gateway.backend import (
    BackendError,
    ModelFacts,
    RequestRejected,
    TokenDelta,
    TokenLogprobs,
)


class LocalBackend:
    """`Backend` over an `AsyncLLMEngine` in this process."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._facts: ModelFacts | None = None

    async def model_info(self) -> ModelFacts:
        if self._facts is None:
            core = self.engine.engine
            self._facts = ModelFacts(
                model_name=self.model_name,
                eos_token_ids=frozenset(core.eos_token_ids),
                max_model_len=core.max_model_len,
                has_chat_template=bool(getattr(core.tokenizer, "chat_template", None)),
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
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[int]:
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template; pass chat_template")
        try:
            ids = await asyncio.to_thread(
                tokenizer.apply_chat_template, messages, tokenize=True, return_dict=False,
                add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            )
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors from the template, e.g. a role it rejects
            raise ValueError(str(exc)) from exc
        return list(ids)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prior_output_token_ids: list[int] | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """Token deltas of one sequence from the engine, after `prior_output_token_ids` when
        given. Closing this generator closes the engine's stream, which aborts the request and
        frees its KV blocks."""
        engine_params = params.clone(
            n=1, output_kind=RequestOutputKind.DELTA, detokenize=False, stop=None,
            include_stop_str_in_output=False,
        )
        stream = self.engine.generate(list(prompt_token_ids), engine_params, request_id,
                                      prior_output_token_ids=prior_output_token_ids)
        try:
            async for out in stream:
                yield _to_delta(out.outputs[0])
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
