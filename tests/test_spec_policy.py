"""The draft policy: measured step costs, the goodput plan, acceptance judged without verifying."""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.planner import DraftPlanner
from engine.spec_decode.policy import (
    PROBE_EVERY,
    judge_unverified,
    observe,
    own_limit,
    plan_drafts,
    probe,
)
from engine.spec_decode.step_costs import StepCosts

# step seconds by query tokens: the CPU's shape (flat to 4 rows, a jump at 5)
CPU_COSTS = {1: 16.0, 2: 17.0, 3: 18.0, 4: 20.0, 5: 32.0}


def cpu_costs(t: int, drafted: bool) -> float | None:
    return CPU_COSTS.get(t)


def make_req(acceptance: float = 1.0) -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0), max_tokens=16)
    req.spec_acceptance = acceptance
    return req


def test_step_costs_interpolate_and_guess_unmeasured_sizes_cheap():
    costs = StepCosts()
    costs.observe(5, 1.0)  # a size's first step: not kept
    assert costs.estimate(4) is None
    costs.observe(5, 0.040)
    assert costs.estimate(1) == pytest.approx(0.008)  # below the smallest: scaled down
    costs.observe(1, 0.5)
    costs.observe(1, 0.020)
    assert costs.estimate(3) == pytest.approx(0.030)  # between: interpolated
    assert costs.estimate(9) == pytest.approx(0.040)  # above the largest: as cheap as it
    costs.observe(5, 0.060)
    assert costs.estimate(5) == pytest.approx(0.050, rel=0.01)  # its second step: the mean
    costs.observe(5, 10.0)  # another process took the cores: counts as twice the estimate
    assert costs.estimate(5) == pytest.approx(0.069, rel=0.02)  # (0.04 + 0.06 + 2 x 0.05) / 3


def test_drafted_steps_are_costed_apart_and_never_below_plain_ones():
    costs = StepCosts()
    for seconds in (1.0, 0.025, 0.025):
        costs.observe(8, seconds)
    assert costs.estimate(9, drafted=True) == pytest.approx(0.025)  # none drafted yet: plain's
    for seconds in (1.0, 0.040, 0.040):
        costs.observe(9, seconds, drafted=True)
    assert costs.estimate(9, drafted=True) == pytest.approx(0.040)
    assert costs.estimate(9) == pytest.approx(0.025)  # plain: above the largest, as cheap
    assert costs.estimate(4, drafted=True) == pytest.approx(0.0178, rel=0.01)  # scaled down
    assert costs.estimate(8, drafted=True) == pytest.approx(0.0356, rel=0.01)
    for seconds in (1.0, 0.020, 0.020):  # a drafted size measured cheaper than plain's
        costs.observe(8, seconds, drafted=True)
    assert costs.estimate(8, drafted=True) == pytest.approx(costs.estimate(8))


def test_a_size_measured_long_ago_follows_the_level_of_todays_steps():
    # plain 8-token steps at 25 ms, drafted 12-token ones at 35; then the contexts grow and the
    # plain steps take 34 ms: the drafted size, not measured since, is priced up with them
    costs = StepCosts()
    for _ in range(20):
        costs.observe(8, 0.025)
        costs.observe(12, 0.035, drafted=True)
    for _ in range(30):
        costs.observe(8, 0.034)
    assert costs.estimate(8) == pytest.approx(0.034, rel=0.01)
    assert costs.estimate(12, drafted=True) > 0.044  # 0.035 * 34 / 25 = 0.048 had it all


def test_plan_stops_before_the_jump_in_cost():
    # a = 0.9: 1 + 0.9 + 0.81 + 0.729 = 3.439 tokens in 20 s beats 4.095 in 32 s
    assert plan_drafts([0.9], [4], 1, cpu_costs) == [3]
    assert plan_drafts([0.2], [4], 1, cpu_costs) == [1]  # 1.2 / 17 > 1.24 / 18 > 1 / 16
    assert plan_drafts([0.05], [4], 1, cpu_costs) == [0]
    assert plan_drafts([0.9], [4], 1, lambda t, d: None) == [4]  # nothing measured: all


def test_plan_takes_drafts_only_for_a_gain_beyond_the_margin():
    # batch 8, each draft row adds 1/32 of the step. a = 0.5: one draft gives 8.5 tokens for
    # 1.03 of the time, the best plan (+3%), under the margin: none. a = 0.9: three drafts give
    # 10.44 tokens for 1.09 of the time (+19%)
    def cost(t: int, drafted: bool) -> float:
        return 1.0 + (t - 8) / 32

    assert plan_drafts([0.5] + [0.0] * 7, [3] + [0] * 7, 8, cost) == [0] * 8
    assert plan_drafts([0.9] + [0.0] * 7, [3] + [0] * 7, 8, cost) == [3] + [0] * 7


def test_plan_takes_the_likeliest_drafts_of_the_batch_first():
    def linear(t: int, drafted: bool) -> float:  # a row costs a sixth of the step's fixed cost
        return 6.0 + t

    # 2 requests: the first's drafts pass with 0.9, the second's with 0.2
    assert plan_drafts([0.9, 0.2], [3, 3], 2, linear) == [3, 0]
    # eight requests where a row costs what a token gives: none
    assert plan_drafts([0.6] * 8, [3] * 8, 8, lambda t, d=False: float(t)) == [0] * 8


def test_unverified_drafts_are_judged_against_the_emitted_token():
    req = make_req(0.5)
    req.spec_unverified = 7
    judge_unverified(req, 7)
    assert req.spec_acceptance == pytest.approx(0.65) and req.spec_unverified is None
    judge_unverified(req, 7)  # nothing proposed since: no change
    assert req.spec_acceptance == pytest.approx(0.65)
    req.spec_unverified = 7
    judge_unverified(req, 8)
    assert req.spec_acceptance == pytest.approx(0.455)
    observe(req, 4, 4)  # verified: all four passed
    assert req.spec_acceptance == pytest.approx(0.6185)


def test_probe_every_few_idle_steps():
    req = make_req()
    got = [probe(req, 0) for _ in range(2 * PROBE_EVERY)]
    assert got.count(1) == 2 and got.count(0) == 2 * PROBE_EVERY - 2
    assert probe(req, 3) == 3 and req.spec_idle_steps == 0


def test_seeded_requests_verify_by_their_own_history():
    assert own_limit(1.0, 4) == 4
    assert own_limit(0.6, 4) == 2  # 0.6^2 = 0.36 >= 0.3 > 0.6^3
    assert own_limit(0.2, 4) == 0


def decoding(rid: str, tokens: list[int], **params) -> Request:
    """A request whose prompt is computed: its next step is a decode."""
    req = Request(rid, tokens, SamplingParams(**params), max_tokens=16)
    req.num_computed_tokens = len(tokens) - 1
    return req


def test_planner_cuts_drafts_by_cost_and_keeps_seeded_requests_to_their_history():
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    planner = DraftPlanner(NgramProposer(spec), None)
    greedy = decoding("g", [1, 2, 3, 4, 1, 2])  # proposes 3 4 1
    seeded = decoding("s", [1, 2, 3, 4, 1, 2], temperature=1.0, seed=3)
    planner.costs.estimate = lambda t, d=False: float(t)  # a row costs what a token gives: none pay
    planner.propose([greedy, seeded], 0)
    assert greedy.spec_token_ids == [] and greedy.spec_unverified == 3  # watched for free
    assert seeded.spec_token_ids == [3]  # 0.5 >= 0.3 > 0.25, whatever the costs
    planner.costs.estimate = lambda t, d=False: 1.0  # rows for free: all
    planner.propose([greedy, seeded], 0)
    assert greedy.spec_token_ids == [3, 4, 1] and greedy.spec_unverified is None
