"""Per-request edits of a step's logits that are not sampling knobs: OpenAI's `logit_bias`,
vLLM's `allowed_token_ids` and `bad_words`. Applied by the sampler after the raw logprobs are
taken and before min_tokens, penalties, temperature and the top-k/p filters.

A bad word is a token sequence (the engine tokenizes each word with and without a leading
space, as vLLM does): its last token is forbidden wherever the output so far ends with the rest
of it; a one-token word is forbidden everywhere.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sampler import SamplingRow


def has_controls(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.logit_bias or p.allowed_token_ids or row.bad_words_token_ids)


def apply_token_controls(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` [N, V] with each row's controls applied (`logits` when none has)."""
    idx = [i for i, r in enumerate(rows) if has_controls(r)]
    if not idx:
        return logits
    logits = logits.clone()
    for i in idx:
        r, row = rows[i], logits[i]
        if r.params.allowed_token_ids:
            keep = torch.tensor(r.params.allowed_token_ids, device=row.device)
            kept = row[keep]
            row.fill_(-math.inf)
            row[keep] = kept
        if r.params.logit_bias:
            ids = torch.tensor(list(r.params.logit_bias), device=row.device)
            bias = torch.tensor(list(r.params.logit_bias.values()), dtype=row.dtype,
                                device=row.device)
            row.index_add_(0, ids, bias)
        banned = [seq[-1] for seq in r.bad_words_token_ids
                  if len(seq) == 1 or r.output_token_ids[-(len(seq) - 1):] == seq[:-1]]
        if banned:
            row[torch.tensor(banned, device=row.device)] = -math.inf
    return logits


def bad_words_token_ids(tokenizer: object, words: list[str]) -> list[list[int]]:
    """Each word's token ids, alone and after a space (distinct sequences only)."""
    seqs: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip(" ")):
            ids = list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs
