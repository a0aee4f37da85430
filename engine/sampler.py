"""Batched token sampling for one engine step, with vLLM's semantics.

NOTE: one step, vectorised over the N rows that sample (each stage is skipped when no row needs it):

    raw logits [N, V] ──log_softmax──▶ logprobs: top-k ids + the chosen token's  (raw, unprocessed)
        │
        ├─ min_tokens: eos and stop_token_ids → -inf while the output is shorter than min_tokens
        ├─ repetition penalty (prompt + output tokens), frequency / presence (output only)
        ├─ greedy rows (temperature 0 or top_k 1): argmax
        └─ other rows: ÷ temperature → top-k → top-p → min-p → softmax → invert the CDF at U

A sampled row needs one uniform U (not V noise values, as an exponential race would: on CPU those
cost more than all the rest). A seeded row draws U from its own generator, so a seed gives the
same tokens whatever else is in the batch and wherever the row sits. The only host transfer is the
results; on CPU, where a sync is free, top-p may also redo rows whose nucleus is unusually wide.
Choosing the token lives in `engine.token_choice`; this module owns the logits processing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.device_wait import timed_wait
from engine.host_copy import to_device
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import mask_logits
from engine.token_choice import argmax, index_tensor, padded, pick_tokens, select_rows
from engine.token_controls import apply_token_controls, has_controls

Logprobs = tuple[float, dict[int, float]]


@dataclass
class SamplingRow:
    """One sequence that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far, before this step's token
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None  # the request's own when seeded, on the logits' device
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Greedy, no logprobs, penalties or token controls: its token is the argmax once min_tokens
    # is reached. Fixed for the row's life (the engine keeps a request's row across steps).
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = (p.greedy and p.logprobs is None
                      and (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                      == (1.0, 0.0, 0.0)
                      and not has_controls(self))


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: (chosen token's logprob, {top-k id: logprob}) of the raw distribution, or None when
    # the row did not ask for logprobs.
    logprobs: list[Logprobs | None]


def argmax_suffices(rows: list[SamplingRow]) -> bool:
    """Whether the step's tokens are just the logits' argmax: every row greedy, with no
    logprobs, penalty or min_tokens still to enforce. Then logits in the model's dtype give the
    same tokens as their fp32 upcast (exact: it keeps their order and ties), and the sampler
    takes them as they are."""
    return all(r.plain and len(r.output_token_ids) >= r.params.min_tokens for r in rows)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        default_generator: torch.Generator | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Pick one token per row; `logits` [N, V] float32 (any float dtype where
        `argmax_suffices(rows)`), row i belongs to `rows[i]`.

        `logits` is not modified. Each sampled seeded row advances its own generator by one
        uniform; unseeded rows share one draw from `default_generator` (torch's default generator
        when None). Greedy rows draw nothing.
        """
        return self.sample(logits, rows, default_generator, bitmask).to_host()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        default_generator: torch.Generator | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SampledTokens:
        """As `__call__`, with the results left on the device: nothing waits for the GPU.
        `bitmask` (int32 [N, words], engine/structured/bitmask.py): the tokens each row may
        sample; the others are removed before anything else, logprobs included."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, V], got {list(logits.shape)}")
        if bitmask is None and argmax_suffices(rows):  # skips the per-row passes below
            return SampledTokens(argmax(logits), None)
        if bitmask is not None:
            logits = mask_logits(logits, bitmask)
        raw = RawLogprobs.compute(logits, rows)
        token_ids = pick_tokens(process_logits(logits, rows), rows, default_generator)  # [N] long
        return SampledTokens(token_ids, raw)


class SampledTokens:
    """One step's sampled tokens on the device. `to_host` is the step's only synchronisation;
    on CUDA the ids are already being copied into pinned memory when this is made."""

    def __init__(self, token_ids: torch.Tensor, raw: RawLogprobs | None) -> None:
        self.token_ids = token_ids  # [N] long, on the logits' device
        self._raw = raw
        self._host = token_ids
        self._ready: torch.cuda.Event | None = None
        if token_ids.is_cuda:
            self._host = token_ids.to("cpu", non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def to_host(self) -> SamplerOutput:
        if self._ready is not None:
            timed_wait(self._ready.synchronize)
        token_ids = self._host.tolist()
        if self._raw is None:
            return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(token_ids))
        return SamplerOutput(token_ids=token_ids, logprobs=self._raw.gather(self.token_ids))


@dataclass
class RawLogprobs:
    """Log-probabilities of the raw logits, for the rows that asked for them."""

    rows: list[int]
    ks: list[int]  # how many top tokens each of those rows wants
    logprobs: torch.Tensor  # [L, V]
    top_values: torch.Tensor  # [L, max k]
    top_ids: torch.Tensor  # [L, max k]

    @classmethod
    def compute(cls, logits: torch.Tensor, rows: list[SamplingRow]) -> RawLogprobs | None:
        idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not idx:
            return None
        ks = [min(rows[i].params.logprobs or 0, logits.shape[1]) for i in idx]
        logprobs = torch.log_softmax(select_rows(logits, idx), dim=-1)  # [L, V]
        top_values, top_ids = logprobs.topk(max(ks), dim=-1)  # [L, max k]
        return cls(idx, ks, logprobs, top_values, top_ids)

    def gather(self, token_ids: torch.Tensor) -> list[Logprobs | None]:
        """One (chosen logprob, {top id: logprob}) per batch row; None for rows not asking."""
        chosen_ids = select_rows(token_ids, self.rows).unsqueeze(1)  # [L, 1]
        chosen = self.logprobs.gather(1, chosen_ids).squeeze(1).tolist()  # [L]
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        out: list[Logprobs | None] = [None] * token_ids.shape[0]
        for j, (row, k) in enumerate(zip(self.rows, self.ks, strict=True)):
            out[row] = (chosen[j], dict(zip(ids[j][:k], values[j][:k], strict=True)))
        return out


# ---- logits processing ------------------------------------------------------------------------
def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`logits` [N, V] with each row's token controls, min_tokens and penalties applied (a copy
    where any row has one): what temperature, top-k/p and min-p then shape."""
    logits = apply_token_controls(logits, rows)
    return _apply_penalties_to_rows(_apply_min_tokens(logits, rows), rows)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Forbid eos and stop_token_ids in rows still short of min_tokens (a copy when any)."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) >= r.params.min_tokens:
            continue
        stops = r.eos_token_ids.union(r.params.stop_token_ids or ())
        banned = sorted(t for t in stops if t < vocab)
        row_idx += [i] * len(banned)
        token_idx += banned
    if not row_idx:
        return logits
    logits = logits.clone()
    logits[index_tensor(row_idx, logits.device), index_tensor(token_idx, logits.device)] = -math.inf
    return logits


def _apply_penalties_to_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalised copy of the rows with any penalty (`logits` itself when none has)."""
    idx = [
        i for i, r in enumerate(rows)
        if (r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty)
        != (1.0, 0.0, 0.0)
    ]
    if not idx:
        return logits
    vocab, device = logits.shape[1], logits.device
    sel = [rows[i] for i in idx]
    any_repetition = any(r.params.repetition_penalty != 1.0 for r in sel)
    prompts = [r.prompt_token_ids if any_repetition else [] for r in sel]
    params = to_device(
        [x for r in sel for x in (r.params.repetition_penalty, r.params.frequency_penalty,
                                  r.params.presence_penalty)],
        torch.float64, device,
    ).view(-1, 3).to(logits.dtype)  # [M, 3]
    penalised = apply_penalties(
        select_rows(logits, idx),
        padded(prompts, vocab, device),
        padded([r.output_token_ids for r in sel], vocab, device),
        params[:, 0], params[:, 1], params[:, 2],
    )
    if len(idx) == len(rows):
        return penalised
    logits = logits.clone()
    logits[index_tensor(idx, device)] = penalised
    return logits


def apply_penalties(
    logits: torch.Tensor,  # [M, V]
    prompt_ids: torch.Tensor,  # [M, Lp] long, padded with V
    output_ids: torch.Tensor,  # [M, Lo] long, padded with V
    repetition: torch.Tensor,  # [M]; 1 = off
    frequency: torch.Tensor,  # [M]; 0 = off
    presence: torch.Tensor,  # [M]; 0 = off
) -> torch.Tensor:
    """Penalised copy of `logits` [M, V].

    Repetition (HF/vLLM) over prompt and output tokens: a positive logit is divided by the
    penalty, a negative one multiplied. Then OpenAI's over output tokens only:
    logit -= frequency * count + presence * (count > 0). Only the logits of tokens that occur
    are touched: gathered [M, L], penalised, scattered back.
    """
    m, vocab = logits.shape
    ids = torch.cat([prompt_ids, output_ids], dim=1)  # [M, L]
    if ids.shape[1] == 0:
        return logits.clone()
    counts = torch.zeros(m, vocab + 1, dtype=logits.dtype, device=logits.device)  # [M, V + 1]
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    # Padding points at one of the row's own tokens, so every write to a position is the same.
    last = ids.masked_fill(ids >= vocab, -1).amax(dim=1, keepdim=True)  # [M, 1]; -1: no tokens
    idx = torch.where(ids < vocab, ids, last.clamp_min(0))  # [M, L]
    values, count = logits.gather(1, idx), counts.gather(1, idx)  # [M, L]
    rep = repetition.unsqueeze(1)
    penalised = torch.where(values > 0, values / rep, values * rep)
    penalised = penalised - frequency.unsqueeze(1) * count - presence.unsqueeze(1) * (count > 0)
    return logits.scatter(1, idx, torch.where(last >= 0, penalised, values))
