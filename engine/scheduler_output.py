"""What crosses the scheduler's boundary: each step's batch (`SchedulerOutput`), what the model
runner sampled for it (`Sample`), and a snapshot of the scheduler's load (`SchedulerStats`).

Plain torch-free dataclasses: the model runner reads the batch, the services report the stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request

# What the model runner sampled for one request: the token and, if asked for, its logprobs.
Sample = tuple[int, "tuple[float, dict[int, float]] | None"]


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens [start, start + num_new_tokens) of the request
    start: int = field(init=False)  # num_computed_tokens when scheduled
    # The chunk reaches the end of the sequence, so its logits are sampled.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        r = self.request
        self.start = r.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == r.num_tokens + r.num_pending


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
