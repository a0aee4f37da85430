"""Choosing one token per row from processed logits: argmax for greedy rows; temperature,
top-k, top-p and min-p, then inverting the CDF at one uniform draw for the others.

A sampled row costs one uniform (not V noise values as an exponential race would); a seeded row
draws it from its own generator, so a seed gives the same tokens whatever else is batched.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.host_copy import to_device
from engine.lazy_kernels import has_triton, kernel
from engine.sampling_params import SamplingParams

argmax_rows = kernel("argmax", "argmax_rows") if has_triton() else None
sample_rows = kernel("sample_cdf", "sample_rows") if has_triton() else None

if TYPE_CHECKING:
    from engine.sampler import SamplingRow

# On CPU, top-p without a smaller top-k first looks for the nucleus among this many most likely
# tokens (a partial top-k is far cheaper than sorting the vocabulary), then 8x as many for rows
# whose nucleus is wider, and so on. Other devices sort the whole vocabulary: no host sync.
TOP_P_CANDIDATES = 1024

# Tokens per block of the two-level CDF that sampling inverts.
CDF_BLOCK = 256


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N] ids of each row's largest logit, the lowest on a tie (a NaN counts as the largest):
    two short Triton passes on CUDA (torch gives a whole 128k-token row to one block), numpy's
    argmax on the CPU, over the rows widened to fp32 (same answer as torch's; on the 2-core box
    torch's took 73-139 us for one row of 49k fp32 logits and 3.1-4.1 ms for 32 rows, numpy's
    6.5 us and 84 us; torch's bf16 argmax there was slower still); torch elsewhere."""
    if logits.is_cuda and argmax_rows is not None:
        return argmax_rows(logits)
    if logits.device.type == "cpu":
        rows = logits.float().numpy()  # .float(): the tensor itself when already fp32
        return torch.as_tensor(np.argmax(rows, axis=-1), dtype=torch.int64)
    return logits.argmax(dim=-1)


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] ids of each row's k largest logits, in no particular order (k <= V): numpy's
    partition on the CPU (linear in V; torch's topk of 8 over 49k logits cost about what its
    argmax does, above), torch's topk elsewhere."""
    if logits.device.type == "cpu":
        ids = np.argpartition(logits.float().numpy(), -k, axis=-1)[..., -k:]
        return torch.from_numpy(np.ascontiguousarray(ids)).to(torch.int64)
    return logits.topk(k, dim=-1).indices


def pick_tokens(
    logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator | None
) -> torch.Tensor:
    """[N] token ids: argmax for greedy rows, a sample for the others."""
    sample_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sample_idx:
        return argmax(logits)
    sample_rows = [rows[i] for i in sample_idx]
    sampled = _sample(select_rows(logits, sample_idx), sample_rows, default_generator)
    if len(sample_idx) == len(rows):
        return sampled
    token_ids = argmax(logits)  # [N]; the sampled rows' are overwritten
    token_ids[index_tensor(sample_idx, logits.device)] = sampled
    return token_ids


def _sample(
    logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator | None
) -> torch.Tensor:
    """[M] sampled ids from `logits` [M, V] (a copy is processed, never the argument). On CUDA,
    rows with a temperature alone (no top-k, top-p, min-p) take the fused kernel: the same
    uniform per row, the same inversion, two launches instead of ~40 ops."""
    generators = [r.generator for r in rows]
    if _fused(logits, rows):
        temperature = to_device([r.params.temperature for r in rows], torch.float32,
                                logits.device)
        uniform = draw_uniforms(len(rows), 1, generators, default_generator, logits.device)
        return sample_rows(logits, temperature, uniform.view(-1))
    return _invert_cdf(target_probs(logits, rows), generators, default_generator)


def _fused(logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
    """Whether `_sample` takes kernels/sample_cdf.py for these rows."""
    return (logits.is_cuda and sample_rows is not None and logits.stride(-1) == 1
            and all(_plain(r.params) for r in rows))


def _plain(params: SamplingParams) -> bool:
    """Whether a sampled row's distribution is its logits' softmax at its temperature alone."""
    return params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0


def target_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[M, V] the distribution each row samples from, unnormalised (min-p zeroes tokens without
    renormalising): `logits` [M, V] ÷ temperature, top-k, top-p, softmax, min-p. `logits` is
    not modified."""
    params = [r.params for r in rows]
    vocab, device = logits.shape[1], logits.device
    knobs = to_device(
        [x for p in params for x in (p.temperature, min(p.top_k or vocab, vocab),
                                     p.top_p if p.top_p < 1.0 else math.inf, p.min_p)],
        torch.float64, device,
    ).view(-1, 4)  # [M, 4]: temperature, top_k (V = off), top_p (inf = off), min_p
    logits = logits / knobs[:, 0:1].to(logits.dtype)
    restricted = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if restricted:
        num = _num_candidates([params[i] for i in restricted], vocab, device)
        top_k, top_p = knobs[:, 1].long(), knobs[:, 2].to(logits.dtype)
        logits = _restrict_rows(logits, restricted, top_k, top_p, num)
    probs = logits.softmax(dim=-1)  # [M, V]
    if any(p.min_p > 0.0 for p in params):
        probs = apply_min_p(probs, knobs[:, 3].to(probs.dtype))
    return probs


def _num_candidates(params: list[SamplingParams], vocab: int, device: torch.device) -> int:
    """How many most likely tokens top-k/top-p must examine for rows with these params."""
    if device.type != "cpu":
        return vocab
    top_ks = [p.top_k for p in params if 0 < p.top_k < vocab]
    if len(top_ks) == len(params):  # every row has a top-k: the nucleus lies within it
        return max(top_ks)
    return min(vocab, max(top_ks + [TOP_P_CANDIDATES]))


def _restrict_rows(
    logits: torch.Tensor,  # [M, V], private: rewritten in place
    idx: list[int],
    top_k: torch.Tensor,  # [M] long
    top_p: torch.Tensor,  # [M]
    num_candidates: int,
) -> torch.Tensor:
    """Apply top-k/top-p to rows `idx` of `logits`. Rows whose nucleus is wider than
    `num_candidates` are redone with 8x as many, up to the vocabulary (host syncs: CPU only)."""
    sub, sub_k, sub_p = select_rows(logits, idx), select_rows(top_k, idx), select_rows(top_p, idx)
    masked, exact = apply_top_k_top_p(sub, sub_k, sub_p, num_candidates)
    while num_candidates < logits.shape[1] and not bool(exact.all()):
        num_candidates = min(8 * num_candidates, logits.shape[1])
        wide = (~exact).nonzero().squeeze(1)
        masked[wide], exact[wide] = apply_top_k_top_p(
            sub[wide], sub_k[wide], sub_p[wide], num_candidates
        )
    if len(idx) == logits.shape[0]:
        return masked
    logits[index_tensor(idx, logits.device)] = masked
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,  # [M, V]
    top_k: torch.Tensor,  # [M] long; V = off
    top_p: torch.Tensor,  # [M] float; inf = off
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy of `logits` with tokens outside each row's top-k, then top-p nucleus, set to -inf.

    top-k keeps exactly k tokens (ties broken by `torch.topk`). top-p keeps the smallest set of
    most likely tokens whose probability (renormalised after top-k) reaches top_p; at least one.
    Only the `num_candidates` most likely tokens of each row are examined: the second result,
    exact [M] bool, is False for rows whose nucleus may extend past them.
    """
    vocab = logits.shape[1]
    values, ids = logits.topk(num_candidates, dim=-1)  # [M, K], descending
    position = torch.arange(num_candidates, device=logits.device)  # [K]
    values = values.masked_fill(position >= top_k.unsqueeze(1), -math.inf)
    k_inside = top_k <= num_candidates  # [M]: the top-k set is all among the candidates
    log_norm = values.logsumexp(dim=-1)  # [M]: renormalised over the top-k...
    if num_candidates < vocab:  # ...or over the whole vocabulary for rows without one
        log_norm = torch.where(k_inside, log_norm, logits.logsumexp(dim=-1))
    probs = (values - log_norm.unsqueeze(1)).exp()  # [M, K]
    mass = probs.cumsum(dim=-1)  # [M, K]
    # A token goes once the tokens ranked above it already hold top_p.
    values = values.masked_fill(mass - probs >= top_p.unsqueeze(1), -math.inf)
    exact = k_inside | (mass[:, -1] >= top_p) | (num_candidates >= vocab)
    masked = torch.full_like(logits, -math.inf).scatter_(1, ids, values)
    return masked, exact


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Copy of `probs` [M, V] with tokens below min_p [M] × the row's top probability zeroed."""
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [M, 1]
    return probs.masked_fill(probs < threshold, 0.0)


def _invert_cdf(
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """[M] one token per row of `probs` [M, V] (unnormalised is fine): the token whose CDF
    interval holds a uniform draw; zero-probability tokens have empty intervals. Two levels in
    float64 (which block of tokens, then which token in it): one float32 cumsum over V would
    round the intervals of the least likely tokens to nothing."""
    uniform = draw_uniforms(probs.shape[0], 1, generators, default_generator, probs.device)
    return invert_cdf_at(probs, uniform)


def draw_uniforms(
    m: int, per_row: int, generators: list[torch.Generator | None],
    default_generator: torch.Generator | None, device: torch.device,
) -> torch.Tensor:
    """[m, per_row] float64 uniforms in [0, 1): row i's from `generators[i]` (its request's own,
    seeded) or, where that is None, from `default_generator`."""
    uniform = torch.empty(m, per_row, dtype=torch.float64, device=device)
    if any(g is None for g in generators):
        uniform.uniform_(generator=default_generator)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i].uniform_(generator=generator)
    return uniform


def invert_cdf_at(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[M] the token of each row of `probs` [M, V] (unnormalised, some mass) whose CDF interval
    holds `uniform` [M, 1] float64 (see `_invert_cdf`)."""
    m, vocab = probs.shape
    full = vocab - vocab % CDF_BLOCK
    block_mass = [probs[:, :full].reshape(m, -1, CDF_BLOCK).sum(dim=-1)]  # [M, V // BLOCK]
    if full < vocab:
        block_mass.append(probs[:, full:].sum(dim=-1, keepdim=True))
    block, within = _invert(torch.cat(block_mass, dim=1).double(), uniform)  # [M, 1] each
    ids = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)  # [M, BLOCK]
    mass = probs.gather(1, ids.clamp_max(vocab - 1)).masked_fill(ids >= vocab, 0.0)
    offset, _ = _invert(mass.double(), within)
    return (block * CDF_BLOCK + offset).squeeze(1)


def _invert(mass: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For `mass` [M, K] float64 and `uniform` [M, 1] in [0, 1): the index [M, 1] of the interval
    holding uniform × total on the row's CDF, and where in that interval it lies, in [0, 1)."""
    cdf = mass.cumsum(dim=-1)  # [M, K], non-decreasing
    total = cdf[:, -1:]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True)  # [M, 1]: mass[idx] > 0
    before = torch.where(idx > 0, cdf.gather(1, (idx - 1).clamp_min(0)), 0.0)
    within = (target - before) / mass.gather(1, idx)
    return idx, within.clamp(0.0, 1.0 - 2.0**-53)


# ---- helpers ----------------------------------------------------------------------------------
def index_tensor(idx: list[int], device: torch.device) -> torch.Tensor:
    return to_device(idx, torch.long, device)


def select_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows `idx` (sorted, distinct) of `t`; `t` itself when that is every row."""
    return t if len(idx) == t.shape[0] else t[index_tensor(idx, t.device)]


def padded(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), longest] long tensor of `seqs`, right-padded with `pad`."""
    width = max((len(s) for s in seqs), default=0)
    flat = [t for s in seqs for t in s + [pad] * (width - len(s))]
    return to_device(flat, torch.long, device).view(len(seqs), width)


def skip_draws(generator: torch.Generator, num_samples: int) -> None:
    """Advance a seeded row's generator past `num_samples` samples, drawn exactly as
    `_invert_cdf` draws them (one float64 uniform each): a request whose first tokens were
    sampled on another worker continues the random sequence it would have had in one engine."""
    for _ in range(num_samples):
        torch.empty(1, dtype=torch.float64, device=generator.device).uniform_(generator=generator)

