"""A request's life inside the engine: its tokens, its KV progress and its state machine.

Torch-free. One `Request` is one sequence; a prompt with `n` > 1 becomes `n` sibling requests
(`parent_id` shared, `index` 0..n-1) whose outputs the engine gathers into one `RequestOutput`.

    WAITING ──schedule──▶ RUNNING ──eos/stop/length──▶ FINISHED_*
       ▲                     │
       └──── PREEMPTED ◀─────┘   (blocks freed; recomputed from scratch when readmitted)
    any non-finished state ──abort──▶ FINISHED_ABORTED

    decode role: WAITING_FOR_KV (blocks reserved, bytes arriving) ──commit──▶ WAITING ──▶ …
                 WAITING_FOR_BLOCKS (cache full: queued) ──blocks freed──▶ WAITING_FOR_KV
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.backend import GrammarMatcher


_FINISH_REASONS = {"finished_stopped": "stop", "finished_length": "length",
                   "finished_aborted": "abort"}


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    WAITING_FOR_BLOCKS = "waiting_for_blocks"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        # Plain attributes, not properties over a dict: every request asks several times a
        # step, and an Enum member's hash is a Python call.
        self.finish_reason: str | None = _FINISH_REASONS.get(value)
        self.finished = self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of a request's milestones."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class Request:
    """One sequence: prompt, generated tokens and how much of it has KV in the cache.

    Invariant (between steps): `num_computed_tokens <= num_tokens + num_pending`; the tokens
    `[num_computed_tokens, num_tokens + num_pending)` still need a forward pass. The scheduler
    advances `num_computed_tokens` when it schedules a chunk; a chunk that reaches the end samples
    a token, counted in `num_pending` until it is appended (with asynchronous scheduling the next
    step is scheduled, and its input built, before that). `block_ids` is the block table; only
    the block manager writes it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved from sampling_params and the context length by the engine
    parent_id: str = ""
    index: int = 0
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # One entry per output token when logprobs were asked for: (chosen logprob, {id: logprob}).
    output_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending: int = 0  # tokens sampled in launched steps, not appended yet
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    # Bumped by the block manager whenever it changes block_ids (its only writer): host copies
    # of the table (engine/input_batch.py's HostBlockTables) are rebuilt only then.
    block_table_version: int = 0
    # Prefix-cache bookkeeping (block manager): chain hashes of this request's full blocks, and how
    # many of its leading blocks are registered in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # from bad_words
    # prompt_logprobs: entry p is prompt token p + 1's (logprob, rank, {top id: logprob})
    prompt_logprobs: list[tuple[float, int, dict[int, float]]] = field(default_factory=list)
    # Structured outputs: the grammar's matcher (engine/structured/backend.py), fed every token
    grammar: GrammarMatcher | None = None
    # Speculative decoding: tokens proposed to follow this request's last one (engine/spec_decode/),
    # set by the engine before each step; the scheduler verifies them with its next decode.
    spec_token_ids: list[int] = field(default_factory=list)
    # how likely its drafts pass (moving average), steps since it last had drafts, and the
    # first draft of a proposal it did not verify (judged against the token its step emits):
    # the draft policy's (engine/spec_decode/policy.py); a prior of one draft in two passing
    spec_acceptance: float = 0.5
    spec_idle_steps: int = 0
    spec_unverified: int | None = None
    # Multi-LoRA: the adapter this request runs under (engine/lora/), None for the base model.
    # It also keys the request's prefix-cache hashes (engine/block_manager.py).
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if not self.parent_id:
            self.parent_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the full list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int, logprobs: tuple[float, dict[int, float]] | None) -> None:
        if self.grammar is not None:
            self.grammar.accept(token_id)  # sampled under its mask: accepted
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
