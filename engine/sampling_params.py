"""Per-request sampling parameters, shaped like vLLM's so users can switch.

Validated once at construction: every bad value raises `ValueError` naming the field.
Torch-free, so the scheduler and the services can carry it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from engine.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output holds the whole text so far
    DELTA = "delta"  # every output holds only what is new since the last one
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. `seed` makes one request reproducible whatever else runs in its
    batch. `n` > 1 samples that many completions from one prompt; they share the prompt's KV
    blocks. `logprobs=k` returns the chosen token's log-probability and the top k of the model's
    raw (unprocessed) distribution at each step. `stop` strings are removed from the text unless
    `include_stop_str_in_output`; `stop_token_ids` end the request like eos does.
    `structured_outputs` constrains every sampled token to a grammar (JSON schema, regex, choice,
    EBNF); logprobs then come from the constrained distribution.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # Logprobs of every prompt token (after the first) and this many top alternatives at each
    # position; the prompt is then computed in full (no prefix-cache hits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Added to the logits of these token ids (OpenAI's logit_bias: -100 bans, 100 forces).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated (vLLM's bad_words: their token sequences are blocked).
    bad_words: list[str] | None = None
    # The output must match this (a JSON schema, regex, choice or grammar): engine/structured/
    structured_outputs: StructuredOutputsParams | None = None
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.output_kind, str):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                kinds = [k.value for k in RequestOutputKind]
                raise ValueError(f"output_kind must be one of {kinds}") from None
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=0)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        if not all(isinstance(s, str) and s for s in self.stop_list):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        self._validate_controls()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    def _validate_controls(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases")
            bias = {}
            for key, value in self.logit_bias.items():  # JSON gives the ids as strings
                token = int(key) if isinstance(key, str) and key.isdigit() else key
                bias[_check_int("logit_bias", token, low=0)] = _check_number("logit_bias", value)
            self.logit_bias = bias
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, low=0)
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError("bad_words must be a list of non-empty strings")

    def token_ids_used(self) -> list[int]:
        """Every token id the request names (checked against the vocabulary by the engine)."""
        return [*(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy with some fields changed (used to fan out `n` > 1)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        fields.update(changes)
        return SamplingParams(**fields)


def _check_int(name: str, value: object, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _check_number(name: str, value: object, low: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return float(value)
