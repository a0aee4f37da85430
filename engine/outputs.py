"""What the engine hands back: vLLM's `RequestOutput` / `CompletionOutput` shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

# One step's logprobs: the chosen token's and the top-k, as {token_id: Logprob}.
SampleLogprobs = list[dict[int, "Logprob"]]
# Per prompt token: None for the first (nothing predicts it), then as SampleLogprobs.
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when unknown (the chosen token outside top-k)
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a prompt's `n` completions. In delta mode `text`/`token_ids` hold only what is new."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Seconds (time.monotonic) of a prompt's milestones, over its `n` completions."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None


def prompt_logprob_entries(
    prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs, k: int
) -> list[tuple[float, int, dict[int, float]]]:
    """`RequestOutput.prompt_logprobs` ([None, {id: Logprob}, ...]) as plain tuples, one per
    prompt position after the first: (its token's logprob, its rank, {top-k id: logprob}).
    The top k are the entries ranked 1..k; the prompt token is among them or extra."""
    out = []
    for token_id, step in zip(prompt_token_ids[1:], prompt_logprobs[1:]):
        assert step is not None
        chosen = step[token_id]
        top = {t: lp.logprob for t, lp in step.items() if lp.rank is not None and lp.rank <= k}
        out.append((chosen.logprob, chosen.rank or 0, top))
    return out
