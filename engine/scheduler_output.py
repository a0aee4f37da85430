"""What crosses the scheduler's boundary: each step's batch (`SchedulerOutput`), what the model
runner sampled for it (`Sample`), and a snapshot of the scheduler's load (`SchedulerStats`).

Plain torch-free dataclasses: the model runner reads the batch, the services report the stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request

# What the model runner sampled for one request: the token and, if asked for, its logprobs.
Sample = tuple[int, "tuple[float, dict[int, float]] | None"]
# A request verified with draft tokens emits several: the accepted drafts, then one more.
Samples = list[Sample]


class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of it, the draft
    tokens (speculative decoding, beyond the request's tokens, verified in this step) last.
    `samples`: the chunk reaches the end of the sequence, so its logits are sampled.

    A plain class with slots: every running request makes one every step."""

    __slots__ = ("request", "num_new_tokens", "spec_token_ids", "start", "samples")

    def __init__(self, request: Request, num_new_tokens: int,
                 spec_token_ids: list[int] | None = None) -> None:
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.spec_token_ids = spec_token_ids if spec_token_ids is not None else []
        self.start = request.num_computed_tokens  # when scheduled
        end = self.start + num_new_tokens - len(self.spec_token_ids)
        self.samples = end == request.num_tokens + request.num_pending

    def __repr__(self) -> str:
        return (f"ScheduledRequest({self.request.request_id!r}, start={self.start}, "
                f"num_new_tokens={self.num_new_tokens}, spec_token_ids={self.spec_token_ids}, "
                f"samples={self.samples})")


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_waiting_for_blocks: int = 0  # decode role: reservations queued for free blocks
    num_cached_blocks: int = 0  # blocks registered in the prefix cache (held or free)
    # structured outputs (engine/structured/manager.py), filled in by the engine
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_bitmask_seconds: float = 0.0
    # speculative decoding (vLLM's names): verifications with drafts, draft tokens, accepted ones
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # draft j accepted, per j
    # multi-LoRA (vLLM's lora_requests_info): adapters of running / waiting requests
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens emitted per verification with drafts (accepted + the one sampled); 0: none."""
        if not self.spec_decode_num_drafts:
            return 0.0
        return 1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts


@dataclass
class SpecDecodeCounts:
    """The scheduler's speculative-decoding counters since it started."""

    num_drafts: int = 0  # verifications of a request's drafts (vLLM's "num_drafts")
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: times draft j was accepted

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` drafts, of which the first `num_accepted` passed."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
