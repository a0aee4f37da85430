"""kernels/sample_cdf.py (under the Triton interpreter on CPU) against float64 softmax CDFs and
engine/token_choice.py's torch inversion: the token's interval holds the uniform, zero-mass
tokens are never drawn, and evenly spaced uniforms land on each token as often as its mass."""

from __future__ import annotations

import math

import pytest
import torch

from engine.token_choice import invert_cdf_at
from kernels.sample_cdf import sample_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cdf(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[M, V] float64 cdf of softmax(logits / T), normalised."""
    probs = (logits.double() / temperature.double()[:, None]).softmax(dim=-1)
    return probs.cumsum(dim=-1)


def _assert_in_interval(tokens: torch.Tensor, cdf: torch.Tensor, u: torch.Tensor) -> None:
    upper = cdf.gather(1, tokens[:, None]).squeeze(1)
    lower = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp_min(0)[:, None]).squeeze(1),
                        0.0)
    tol = 1e-6
    assert bool((upper > lower).all()), "a zero-mass token was drawn"
    assert bool(((lower - tol <= u) & (u <= upper + tol)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_hold_their_uniform_and_mostly_equal_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 24, 1000  # 4 CDF blocks, the last one partial
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.1
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    tokens = sample_rows(logits.to(DEVICE), temperature.to(DEVICE), u.to(DEVICE)).cpu()
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    _assert_in_interval(tokens, _cdf(logits.float(), temperature), u)
    probs = (logits.float() / temperature[:, None]).softmax(dim=-1)
    reference = invert_cdf_at(probs, u[:, None])
    assert (tokens == reference).sum() >= rows - 1  # they differ only at an interval's edge


def test_masked_tokens_and_blocks_are_never_drawn():
    gen = torch.Generator().manual_seed(1)
    rows, vocab = 16, 700
    logits = torch.full((rows, vocab), -math.inf)
    allowed = [torch.randperm(vocab, generator=gen)[: 1 + i % 5] for i in range(rows)]
    for i, ids in enumerate(allowed):  # whole blocks of -inf, a few tokens left
        logits[i, ids] = torch.randn(len(ids), generator=gen)
    u = torch.cat([torch.tensor([0.0, 1.0 - 2.0**-53]), torch.rand(rows - 2, generator=gen,
                                                                  dtype=torch.float64)])
    tokens = sample_rows(logits.to(DEVICE), torch.ones(rows, device=DEVICE), u.to(DEVICE)).cpu()
    for i, ids in enumerate(allowed):
        assert int(tokens[i]) in set(ids.tolist())
    assert int(tokens[0]) == min(allowed[0].tolist())  # u = 0: the first token with mass
    assert int(tokens[1]) == max(allowed[1].tolist())  # u -> 1: the last


def test_evenly_spaced_uniforms_land_on_each_token_as_often_as_its_mass():
    """N uniforms (i + 0.5) / N over one row: the count of token t is N p_t within one."""
    vocab, n = 300, 400
    logits = torch.linspace(-2.0, 2.0, vocab)[torch.randperm(vocab,
                                                             generator=torch.Generator().manual_seed(2))]
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = sample_rows(logits.expand(n, vocab).contiguous().to(DEVICE),
                         torch.full((n,), 0.7, device=DEVICE), u.to(DEVICE)).cpu()
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = n * (logits.double() / 0.7).softmax(dim=-1)
    assert float((counts - expected).abs().max()) <= 1.0 + 1e-6


def test_bad_shapes_are_refused():
    logits = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="one value per row"):
        sample_rows(logits, torch.ones(3, device=DEVICE), torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        sample_rows(logits.t(), torch.ones(10, device=DEVICE), torch.zeros(10, device=DEVICE))


def test_sampled_rows_draw_the_same_tokens_fused_or_not(monkeypatch):
    """engine/token_choice.py `_sample`: plain-temperature rows take the kernel (forced here on
    the CPU, where the engine keeps torch's path) and draw the same uniforms from the same
    generators, so seeded rows get the tokens torch's path gives them; a top-p row keeps it."""
    from engine import token_choice
    from engine.sampler import SamplingRow
    from engine.sampling_params import SamplingParams

    rows_n, vocab = 12, 600
    logits = (torch.randn(rows_n, vocab, generator=torch.Generator().manual_seed(3)) * 2).to(
        DEVICE)

    def rows(**extra) -> list[SamplingRow]:
        return [SamplingRow(SamplingParams(temperature=0.5 + 0.1 * i, seed=i, **extra), [1], [],
                            frozenset(), torch.Generator(DEVICE).manual_seed(100 + i))
                for i in range(rows_n)]

    default = torch.Generator(DEVICE).manual_seed(7)
    reference = token_choice._invert_cdf(token_choice.target_probs(logits, rows()),
                                         [r.generator for r in rows()], default)
    monkeypatch.setattr(token_choice, "_fused",
                        lambda t, r: token_choice.sample_rows is not None
                        and all(token_choice._plain(x.params) for x in r))
    calls = []
    kernel = token_choice.sample_rows
    monkeypatch.setattr(token_choice, "sample_rows", lambda *a: calls.append(1) or kernel(*a))
    fused = token_choice._sample(logits, rows(), default)
    assert calls == [1] and (fused == reference).sum() >= rows_n - 1
    token_choice._sample(logits, rows(top_p=0.9), default)
    assert calls == [1]  # top-p: torch's path
