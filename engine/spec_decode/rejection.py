"""Verification of draft tokens by rejection sampling (Leviathan et al. 2023), exact.

NOTE: a request with k drafts d_0..d_{k-1} has k + 1 rows of logits: row j is the target's
distribution p_j for the token after the drafts before it (its sampling row sees them as output
history, so penalties, min_tokens and bad words apply per position). The proposer's q is 1 on its
draft (n-gram drafts are deterministic), so Leviathan's min(1, p/q) and max(p - q, 0) become:

    row j < k:  accept d_j with probability p_j(d_j); on rejection emit a draw from p_j with
                d_j removed (renormalised), and stop
    row k:      all k accepted: a bonus token drawn from p_k
    greedy:     accept while d_j == argmax p_j; the first mismatch emits the argmax

Every emitted token is then distributed exactly as p_j (P(d) = p(d); P(y != d) =
(1 - p(d)) p(y) / (1 - p(d))). Each sampled row draws two uniforms (accept, resample) from its
request's generator when seeded, so a seed gives the same tokens whatever else is batched.
Vectorised over every row; the host sees only the final tokens and accept flags.
"""

from __future__ import annotations

import torch

from engine.sampler import RawLogprobs, SamplingRow, process_logits
from engine.scheduler_output import Samples
from engine.token_choice import (
    argmax,
    draw_uniforms,
    index_tensor,
    invert_cdf_at,
    select_rows,
    target_probs,
)

NO_DRAFT = -1  # the draft id of a request's last (bonus) row


def verify(
    logits: torch.Tensor,  # [R, V]: each request's k + 1 rows, in request order
    rows: list[SamplingRow],  # [R]: row j of a request has its drafts before j in its history
    drafts: list[list[int]],  # per request, its k drafts
    default_generator: torch.Generator | None = None,
) -> list[Samples]:
    """Per request, the tokens it emits (the accepted drafts, then one more) with their raw
    logprobs when asked for. `logits` is not modified."""
    flat = [t for d in drafts for t in (*d, NO_DRAFT)]
    if logits.shape[0] != len(rows) or len(rows) != len(flat):
        raise ValueError(
            f"{len(flat)} rows expected, got {len(rows)} and logits {list(logits.shape)}"
        )
    raw = RawLogprobs.compute(logits, rows)
    draft_ids = index_tensor(flat, logits.device)  # [R]
    tokens, accepted = rejection_sample(
        process_logits(logits, rows), rows, draft_ids, default_generator
    )
    logprobs = raw.gather(tokens) if raw is not None else [None] * len(rows)
    tokens_host, accepted_host = tokens.tolist(), accepted.tolist()
    out: list[Samples] = []
    row = 0
    for d in drafts:
        emitted = []
        for j in range(len(d) + 1):
            emitted.append((tokens_host[row + j], logprobs[row + j]))
            if not accepted_host[row + j]:
                break
        out.append(emitted)
        row += len(d) + 1
    return out


def rejection_sample(
    logits: torch.Tensor,  # [R, V] processed (controls, penalties): what temperature etc. shape
    rows: list[SamplingRow],
    draft_ids: torch.Tensor,  # [R] long: the row's draft, NO_DRAFT for a bonus row
    default_generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the token it emits if reached (the draft when accepted, else a draw from the
    target with the draft removed) [R] long, and whether its draft was accepted [R] bool (False
    for bonus rows)."""
    tokens = argmax(logits)  # [R]: greedy rows' answer; the sampled rows' are overwritten
    accepted = tokens == draft_ids  # [R]
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled:
        return tokens, accepted
    sel_rows = [rows[i] for i in sampled]
    probs = target_probs(select_rows(logits, sampled), sel_rows)  # [M, V], unnormalised
    draft = select_rows(draft_ids, sampled)  # [M]
    has_draft = draft != NO_DRAFT
    at = draft.clamp_min(0).unsqueeze(1)  # [M, 1]
    p_draft = probs.gather(1, at).squeeze(1).double() / probs.sum(dim=-1).double()  # [M]
    uniform = draw_uniforms(
        len(sel_rows), 2, [r.generator for r in sel_rows], default_generator, probs.device
    )  # [M, 2]: accept, resample
    accept = has_draft & (uniform[:, 0] < p_draft)
    residual = probs.scatter(1, at, 0.0)
    residual = torch.where((has_draft & (residual.sum(dim=-1) > 0)).unsqueeze(1), residual, probs)
    drawn = invert_cdf_at(residual, uniform[:, 1:])  # [M]
    idx = index_tensor(sampled, logits.device)
    tokens[idx] = torch.where(accept, draft, drawn)
    accepted[idx] = accept
    return tokens, accepted
