"""What the gateway needs from whatever serves the model: the seam between the HTTP layer and
the engine, whether it runs in-process (colocated) or across gRPC workers (disaggregated).

The gateway owns the text: it turns token deltas into text incrementally, applies stop strings,
fans out `n` > 1 into `n` single-sequence generations and formats OpenAI responses. A backend
only moves token ids.

Backend request ids: a request's own id for a single sequence, `{id}-{i}` for sequence i of a
fan-out; a sequence generated again after its stream broke (a resumed stream) has `.{tag}`
appended, so that it never meets its earlier self (its cancellation flag, a worker still
aborting it). `state_request_id` maps them back.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams

# (chosen token's logprob, {top token id: logprob}) at one position
TokenLogprobs = tuple[float, dict[int, float]]
# One prompt position after the first: (its token's logprob, that token's rank (1 = most
# likely), {top token id: logprob}), given the prompt tokens before it
PromptTokenLogprobs = tuple[float, int, dict[int, float]]


@dataclass
class TokenDelta:
    """Tokens generated since the previous delta of one sequence."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    stop_reason: int | None = None  # the stop token id, when a token ended it
    # On the first delta only: entry p is prompt token p + 1's, when params.prompt_logprobs
    prompt_logprobs: list[PromptTokenLogprobs] | None = None
    num_cached_tokens: int | None = None  # on the first delta: prompt tokens found cached


@dataclass(frozen=True)
class ModelFacts:
    model_name: str
    eos_token_ids: frozenset[int]
    max_model_len: int
    has_chat_template: bool
    vocab_size: int


class BackendError(RuntimeError):
    """A generation failed inside the serving system (a worker died, a transfer broke).
    `retryable` errors may succeed if sent again (the gateway answers 503 for them)."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class RequestRejected(BackendError):
    """The engine refused the request as given (its ValueError; a worker's INVALID_ARGUMENT):
    what the gateway cannot check itself, chiefly a structured-output constraint that does not
    compile. Answered 400: sending it again would fail again."""


class Backend(Protocol):
    async def model_info(self) -> ModelFacts:
        """The served model's facts (cached after the first call)."""
        ...

    def get_tokenizer(self) -> Any:
        """A local HF tokenizer, for incremental detokenization in the gateway."""
        ...

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ...

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation (OpenAI's messages, content as text) after the chat
        template, which renders `tools` (tokenizer_svc/chat_template.py says which template).
        ValueError if there is none, it fails, or it cannot render the tools."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prior_output_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """Generate one sequence (`params.n` is 1; stop strings are the gateway's job), under
        the LoRA adapter `lora_request` (None: the base model; the gateway passes it only when
        set, so a backend serving no adapters may leave the argument out).

        `prior_output_token_ids`: tokens this sequence generated before (a resumed stream); it
        continues after them, and they count as output (max_tokens, min_tokens, penalties,
        seeded draws) but are not yielded again.

        Yields deltas until one carries a finish_reason. Closing the iterator early (client
        gone, stop string matched) aborts the request everywhere and frees its KV blocks.
        Raises BackendError when the serving system fails the request, RequestRejected when
        the engine refuses it (e.g. a grammar that does not compile).
        """
        ...

    async def ready(self) -> bool:
        """True once a model is loaded and requests can be served."""
        ...

    async def workers(self) -> list[dict[str, Any]]:
        """Every worker serving the model with its role, address and load (WorkerInfo fields),
        for `pdserve status --gateway`."""
        ...

    async def close(self) -> None:
        ...


def state_request_id(backend_id: str) -> str | None:
    """The request whose state a backend request id speaks for: the id itself, or `{id}` for
    sequence 0 of a fan-out (with or without a resume tag); None for the other sequences, so
    that one request's state moves once."""
    base = backend_id.partition(".")[0]
    head, _, tail = base.rpartition("-")
    if not tail.isdigit():
        return base
    return head if tail == "0" else None


def resumed_request_id(backend_id: str, tag: str) -> str:
    """The backend id of a sequence generated again after its stream broke."""
    return f"{backend_id}.{tag}"
