"""The load test's statistics on hand-made timelines (exact values), and its arrival processes
(seeded, at the asked mean rate)."""

from __future__ import annotations

import math
import statistics

import pytest

from loadtest.arrivals import arrival_offsets
from loadtest.metrics import (
    SLO,
    distribution,
    e2e,
    goodput,
    itls,
    meets,
    percentile,
    run_metrics,
    tpot,
    ttft,
)
from loadtest.record import RequestRecord


def rec(sent: float, chunks: list[float], done: float, tokens: int | None = None,
        error: str = "", prompt: int = 10, asked: int | None = None) -> RequestRecord:
    n = len(chunks) if tokens is None else tokens
    return RequestRecord(0, prompt, asked or n, sent_at=sent, chunk_at=chunks, done_at=done,
                         prompt_tokens=prompt, completion_tokens=tokens, error=error)


# A: sent at 1, first chunk at 1.5, 4 chunks, 5 tokens (one chunk held two), done at 3.
A = rec(1.0, [1.5, 2.0, 2.25, 3.0], 3.0, tokens=5)
# B: sent at 2, first chunk at 4, 2 tokens, done at 4.5.
B = rec(2.0, [4.0, 4.5], 4.5, tokens=2)
# C: one token only: no TPOT.
C = rec(0.5, [0.75], 0.75, tokens=1)
FAILED = rec(0.0, [0.25], 1.0, tokens=1, error="HTTP 500: boom")


def test_per_request_latencies():
    assert ttft(A) == 0.5 and e2e(A) == 2.0
    assert tpot(A) == (2.0 - 0.5) / 4  # 4 gaps between 5 tokens
    assert itls(A) == [0.5, 0.25, 0.75]  # per chunk, not per token
    assert (ttft(B), e2e(B), tpot(B), itls(B)) == (2.0, 2.5, 0.5, [0.5])
    assert (ttft(C), tpot(C), itls(C)) == (0.25, None, [])
    assert ttft(rec(0.0, [], 1.0, tokens=0)) is None


def test_output_tokens_prefer_usage_then_chunk_counts_then_chunks():
    r = rec(0.0, [1.0, 2.0], 2.0)
    assert r.output_tokens == 2
    r.chunk_tokens = [1, 3]
    assert r.output_tokens == 4
    r.completion_tokens = 7
    assert r.output_tokens == 7


def test_percentile_interpolates_between_ranks_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(map(float, range(1, 11))), 90) == pytest.approx(9.1)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0], 0) == 1.0 and percentile([3.0, 1.0], 100) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution():
    assert distribution([1.0, 2.0, 3.0, 10.0]) == {
        "mean": 4.0, "median": 2.5, "p90": pytest.approx(7.9), "p99": pytest.approx(9.79),
        "min": 1.0, "max": 10.0}
    assert distribution([]) == dict.fromkeys(["mean", "median", "p90", "p99", "min", "max"])


def test_slo_checks_both_sides_and_a_single_token_meets_tpot():
    assert meets(A, SLO(ttft_s=0.5, tpot_s=0.375))
    assert not meets(A, SLO(ttft_s=0.4))
    assert not meets(A, SLO(tpot_s=0.3))
    assert meets(C, SLO(ttft_s=0.25, tpot_s=0.001))  # no TPOT to miss
    assert not meets(FAILED, SLO(ttft_s=10.0))
    assert meets(B, SLO())
    with pytest.raises(ValueError):
        SLO(ttft_s=0.0)


def test_goodput_is_requests_per_second_meeting_every_slo():
    records = [A, B, C, FAILED]
    assert goodput(records, 4.0, SLO()) is None
    assert goodput(records, 4.0, SLO(ttft_s=1.0)) == 2 / 4  # A, C
    assert goodput(records, 4.0, SLO(ttft_s=2.0, tpot_s=0.4)) == 2 / 4  # A, C (B's TPOT 0.5)
    assert goodput(records, 2.0, SLO(ttft_s=5.0, tpot_s=1.0)) == 3 / 2


def test_run_metrics_of_a_hand_made_run():
    m = run_metrics([A, B, C, FAILED], duration_s=5.0, slo=SLO(ttft_s=1.0))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["prompt_tokens"], m["output_tokens"]) == (30, 8)
    assert m["request_throughput"] == 3 / 5
    assert m["output_token_throughput"] == 8 / 5
    assert m["total_token_throughput"] == 38 / 5
    assert (m["goodput"], m["slo_met"]) == (2 / 5, 2)
    assert m["ttft_s"]["mean"] == pytest.approx((0.5 + 2.0 + 0.25) / 3)
    assert m["ttft_s"]["median"] == 0.5 and m["ttft_s"]["max"] == 2.0
    assert m["tpot_s"]["min"] == 0.375 and m["tpot_s"]["max"] == 0.5  # C has none
    assert sorted([m["itl_s"]["min"], m["itl_s"]["max"]]) == [0.25, 0.75]
    assert m["e2e_s"]["median"] == 2.0
    assert m["output_tokens_short_of_max_tokens"] == 0
    short = rec(0.0, [1.0], 1.0, tokens=1, asked=4)
    assert run_metrics([short], 1.0)["output_tokens_short_of_max_tokens"] == 1
    with pytest.raises(ValueError):
        run_metrics([A], 0.0)


def test_record_round_trips_through_json():
    assert RequestRecord.from_json(A.to_json()) == A


# ---- arrivals ---------------------------------------------------------------------------------
def test_arrivals_are_seeded():
    a = arrival_offsets(50, 2.0, seed=7)
    assert a == arrival_offsets(50, 2.0, seed=7)
    assert a != arrival_offsets(50, 2.0, seed=8)
    assert a[0] == 0.0 and a == sorted(a)
    bursty = arrival_offsets(50, 2.0, burstiness=0.3, seed=7)
    assert bursty == arrival_offsets(50, 2.0, burstiness=0.3, seed=7) and bursty != a


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_keep_the_mean_rate_and_burstiness_sets_the_spread(burstiness):
    offsets = arrival_offsets(20001, 4.0, burstiness=burstiness, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    # gamma(shape k, mean m): coefficient of variation 1 / sqrt(k)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_constant_and_all_at_once():
    assert arrival_offsets(4, 2.0, "constant") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(3, 2.0, "all") == [0.0] * 3
    assert arrival_offsets(3, math.inf) == [0.0] * 3
    assert arrival_offsets(0, 1.0) == []
    for bad in (dict(rate=0.0), dict(rate=1.0, kind="zipf"), dict(rate=1.0, burstiness=0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, **bad)
