"""Sampler: greedy, seeds, top-k/top-p/min-p sets, penalties, min_tokens, logprobs, frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, apply_penalties, argmax_suffices
from engine.sampling_params import SamplingParams
from engine.token_choice import apply_top_k_top_p, argmax, top_ids

EOS = 2
# Five live tokens, then -inf padding: the vocabulary is wider than the sampler's top-p candidate
# set (1024), so its CPU candidate path is the one exercised.
PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]
WIDE_V = 1500


def row(params: SamplingParams, output: list[int] | None = None, seed_gen: bool = True,
        prompt: list[int] | None = None) -> SamplingRow:
    gen = None
    if params.seed is not None and seed_gen:
        gen = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, prompt or [], output or [], frozenset({EOS}), gen)


def five_token_logits(n: int) -> torch.Tensor:
    logits = torch.full((n, WIDE_V), -math.inf)
    logits[:, : len(PROBS)] = torch.tensor(PROBS).log()
    return logits  # [n, WIDE_V]


def sampled_set(n: int, **params: object) -> set[int]:
    rows = [row(SamplingParams(**params)) for _ in range(n)]
    gen = torch.Generator().manual_seed(0)
    return set(Sampler()(five_token_logits(n), rows, gen).token_ids)


def test_greedy_is_argmax_and_logits_untouched() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_p=0.5)] * 3
    out = Sampler()(logits, [row(p) for p in params])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    assert torch.equal(logits, before)


def test_cpu_argmax_and_top_ids_agree_with_torch() -> None:
    """numpy's argmax and partition on the CPU give torch's answers: the lowest id on a tie, a
    NaN as the largest, strided and bf16 rows, a single row; top_ids the same set as topk."""
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(2))
    x[1, 3] = x[1, 7] = 100.0
    x[2, 9] = x[2, 4] = math.nan
    for logits in (x, x[:, ::3], x.bfloat16(), x[0]):
        expected = logits.float().argmax(dim=-1)
        assert argmax(logits).dtype == torch.int64 and torch.equal(argmax(logits), expected)
    rows = x[[0, 3, 4]]
    assert torch.equal(top_ids(rows, 8).sort(dim=-1).values,
                       rows.topk(8, dim=-1).indices.sort(dim=-1).values)


@pytest.mark.parametrize(("params", "output", "suffices"), [
    ({"temperature": 0.0}, [], True),
    ({"temperature": 1.0, "top_k": 1}, [], True),
    ({"temperature": 0.7}, [], False),  # sampled: softmax in fp32
    ({"temperature": 0.0, "logprobs": 0}, [], False),  # logprobs in fp32
    ({"temperature": 0.0, "repetition_penalty": 1.2}, [], False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, [], False),
    ({"temperature": 0.0, "min_tokens": 2}, [5], False),  # eos still banned
    ({"temperature": 0.0, "min_tokens": 2}, [5, 6], True),  # min_tokens reached
])
def test_bf16_logits_give_the_fp32_tokens_where_argmax_suffices(
    params: dict, output: list[int], suffices: bool
) -> None:
    """The runner skips the fp32 upcast of the logits when `argmax_suffices`: the tokens must
    be those of the upcast logits (ties included: bf16 has many)."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 300, generator=gen) * 3).to(torch.bfloat16)
    logits[0, 17] = logits[0, 250] = logits[0].max() + 1  # a tie: the lower id wins
    rows = [row(SamplingParams(**params), output=list(output)) for _ in range(4)]
    assert argmax_suffices(rows) == suffices
    if suffices:
        assert Sampler()(logits, rows).token_ids == Sampler()(logits.float(), rows).token_ids
        assert Sampler()(logits, rows).token_ids[0] == 17
    assert not argmax_suffices([*rows, row(SamplingParams(temperature=0.5))])


def test_top_k_one_is_greedy_at_temperature_one() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    rows = [row(SamplingParams(temperature=1.0, top_k=1)) for _ in range(8)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def _seeded_draws(position: int, batch: int, seed: int = 7, steps: int = 20) -> list[int]:
    """`steps` tokens of one seeded row placed at `position` among `batch` - 1 other rows."""
    own = torch.randn(300, generator=torch.Generator().manual_seed(3))
    logits = torch.randn(batch, 300, generator=torch.Generator().manual_seed(4))
    logits[position] = own  # the seeded row always sees the same logits
    seeded = row(SamplingParams(temperature=0.9, top_p=0.95, min_p=0.01, seed=seed))
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=5),
        SamplingParams(temperature=0.7, seed=99),
        SamplingParams(temperature=1.0, frequency_penalty=1.0),
    ]
    default_gen = torch.Generator().manual_seed(1234 + batch)
    draws = []
    for _ in range(steps):
        rows = [row(others[i % 4]) for i in range(batch - 1)]
        rows.insert(position, seeded)
        draws.append(Sampler()(logits, rows, default_gen).token_ids[position])
    return draws


def test_seeded_row_independent_of_batch_and_position() -> None:
    alone = _seeded_draws(position=0, batch=1)
    assert _seeded_draws(position=0, batch=5) == alone
    assert _seeded_draws(position=3, batch=5) == alone
    assert len(set(alone)) > 5  # really sampling, not stuck on one token
    assert _seeded_draws(position=0, batch=1, seed=8) != alone


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.65}, {0, 1}),
        ({"top_p": 0.75}, {0, 1, 2}),
        ({"top_p": 0.01}, {0}),
        ({"top_k": 3, "top_p": 0.8}, {0, 1}),  # top-p over the top-k renormalised mass
        ({"min_p": 0.3}, {0, 1, 2}),  # keeps p >= 0.3 * 0.4
        ({"top_k": 4, "min_p": 0.3}, {0, 1, 2}),
        ({}, {0, 1, 2, 3, 4}),
    ],
)
def test_filters_keep_exactly_the_expected_set(params: dict, expected: set[int]) -> None:
    assert sampled_set(1000, temperature=1.0, **params) == expected


def test_top_p_nucleus_wider_than_candidates() -> None:
    # Near-uniform, strictly decreasing logits: the 0.9 nucleus is a prefix of ~1350 tokens.
    logits = -torch.arange(WIDE_V, dtype=torch.float32).unsqueeze(0) * 1e-4  # [1, V]
    probs = logits.softmax(dim=-1)[0]
    expected = int((probs.cumsum(0) - probs < 0.9).sum())
    assert expected > 1024
    top_k, top_p = torch.tensor([WIDE_V]), torch.tensor([0.9])
    _, exact = apply_top_k_top_p(logits, top_k, top_p, num_candidates=1024)
    assert exact.tolist() == [False]
    masked, exact = apply_top_k_top_p(logits, top_k, top_p, num_candidates=WIDE_V)
    assert exact.tolist() == [True]
    assert int(masked.isfinite().sum()) == expected

    rows = [row(SamplingParams(temperature=1.0, top_p=0.9)) for _ in range(200)]
    tokens = Sampler()(logits.expand(200, -1), rows, torch.Generator().manual_seed(0)).token_ids
    assert 1024 < max(tokens) < expected


def test_apply_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]]).repeat(3, 1)
    v = 4  # padding id
    prompt = torch.tensor([[0, v], [3, 3], [v, v]])
    output = torch.tensor([[1, 1, 2], [v, v, v], [v, v, v]])
    out = apply_penalties(
        logits, prompt, output,
        repetition=torch.tensor([2.0, 2.0, 2.0]),
        frequency=torch.tensor([0.5, 0.5, 0.5]),
        presence=torch.tensor([0.25, 0.25, 0.25]),
    )
    # row 0: token 0 seen in the prompt: 2 / 2; token 1 twice in the output: -1 * 2 - 2*0.5 - 0.25;
    # token 2 once: 0.5 / 2 - 0.5 - 0.25; token 3 untouched. Row 1: only token 3, in the prompt.
    # Row 2: no tokens at all.
    assert out.tolist() == [[1.0, -3.25, -0.5, 3.0], [2.0, -1.0, 0.5, 1.5], [2.0, -1.0, 0.5, 3.0]]


def _reference_penalties(logits, prompts, outputs, rep, freq, pres) -> torch.Tensor:
    out = logits.clone()
    for i in range(logits.shape[0]):
        for t in set(prompts[i]) | set(outputs[i]):
            x = out[i, t]
            out[i, t] = x / rep[i] if x > 0 else x * rep[i]
        for t in set(outputs[i]):
            out[i, t] -= freq[i] * outputs[i].count(t) + pres[i]
    return out


def test_apply_penalties_matches_reference() -> None:
    gen = torch.Generator().manual_seed(6)
    v = 30
    logits = torch.randn(4, v, generator=gen)
    prompts = [[1, 2, 2, 29], [], [5] * 7, [0, 3]]
    outputs = [[2, 2, 7], [4, 4, 4, 0], [], [3]]
    rep, freq, pres = [1.3, 0.8, 2.0, 1.0], [0.4, -0.5, 1.0, 2.0], [0.0, 1.5, -1.0, 0.5]

    def pad(seqs: list[list[int]]) -> torch.Tensor:
        return torch.tensor([s + [v] * (7 - len(s)) for s in seqs])

    got = apply_penalties(
        logits, pad(prompts), pad(outputs), torch.tensor(rep), torch.tensor(freq),
        torch.tensor(pres),
    )
    assert torch.allclose(got, _reference_penalties(logits, prompts, outputs, rep, freq, pres))


def test_penalties_in_the_sampler() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0]]).expand(3, -1)
    rows = [
        row(SamplingParams(temperature=0.0, repetition_penalty=1.5), output=[0]),  # 2.0 < 2.9
        row(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt=[0]),  # output only
        row(SamplingParams(temperature=0.0, frequency_penalty=0.1), output=[0, 0]),  # 2.8 < 2.9
    ]
    assert Sampler()(logits, rows).token_ids == [1, 0, 1]


def test_min_tokens_forbids_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]]).expand(4, -1)  # eos (2) most likely
    rows = [
        row(SamplingParams(temperature=0.0, min_tokens=3), output=[1]),
        row(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]), output=[1, 1]),
        row(SamplingParams(temperature=0.0, min_tokens=3), output=[1, 1, 1]),
        row(SamplingParams(temperature=0.0, ignore_eos=True)),  # the stop check's business
    ]
    assert Sampler()(logits, rows).token_ids == [3, 4, 2, 2]


def test_logprobs_are_raw_top_k_and_chosen() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    rows = [
        row(SamplingParams(temperature=0.5, repetition_penalty=1.3, logprobs=3), output=[5]),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0, top_k=4, logprobs=0, seed=1)),
    ]
    out = Sampler()(logits, rows, torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, k in ((0, 3), (2, 0)):
        chosen, top = out.logprobs[i]
        assert chosen == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        assert list(top) == raw[i].topk(k).indices.tolist()
        assert list(top.values()) == pytest.approx(raw[i].topk(k).values.tolist(), abs=1e-6)


@pytest.mark.parametrize(
    "token_ids",
    [[0, 1, 2, 3], [0, 255, 256, 520]],  # ...and tokens at the edges of the CDF's blocks
)
def test_temperature_sampling_matches_softmax(token_ids: list[int]) -> None:
    n, temperature = 8000, 0.7
    base = torch.tensor([1.0, 0.5, 0.0, -1.0])
    logits = torch.full((max(token_ids) + 1,), -math.inf)
    logits[token_ids] = base
    rows = [row(SamplingParams(temperature=temperature)) for _ in range(n)]
    out = Sampler()(logits.expand(n, -1), rows, torch.Generator().manual_seed(5))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(logits)).double()
    assert counts.sum() == counts[token_ids].sum()
    expected = (base / temperature).softmax(dim=-1).double() * n
    chi2 = float(((counts[token_ids] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
