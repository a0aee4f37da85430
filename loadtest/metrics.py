"""Serving statistics from request timelines: pure functions, no I/O, no clock.

Definitions (those of vLLM's `bench serve`; DistServe's goodput):

  TTFT   first output chunk - sent                   (per request)
  E2E    end of stream - sent                         (per request)
  TPOT   (E2E - TTFT) / (output tokens - 1)           (per request with >= 2 output tokens)
  ITL    gap between consecutive output chunks        (per chunk: a chunk that carries k
                                                       tokens is one gap, as vLLM counts it)
  goodput  requests per second that completed and met every SLO given: TTFT <= --slo-ttft-ms
           and TPOT <= --slo-tpot-ms (a request with one output token has no TPOT and meets it)

Throughputs divide by the run's duration (first request due to last stream ended). Output tokens
are the server's usage counts (`stream_options.include_usage`) where it sent them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.record import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; None leaves that side unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s)):
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


# ---- one request ------------------------------------------------------------------------------
def ttft(r: RequestRecord) -> float | None:
    return r.chunk_at[0] - r.sent_at if r.chunk_at else None


def e2e(r: RequestRecord) -> float:
    return r.done_at - r.sent_at


def tpot(r: RequestRecord) -> float | None:
    first, n = ttft(r), r.output_tokens
    return None if first is None or n < 2 else (e2e(r) - first) / (n - 1)


def itls(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.chunk_at, r.chunk_at[1:])]


def meets(r: RequestRecord, slo: SLO) -> bool:
    """Completed within every SLO given."""
    first, per_token = ttft(r), tpot(r)
    if not r.ok or first is None:
        return False
    if slo.ttft_s is not None and first > slo.ttft_s:
        return False
    return slo.tpot_s is None or per_token is None or per_token <= slo.tpot_s


# ---- distributions ----------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """mean, median, p90, p99, min and max of `values` (all None when there are none)."""
    xs = list(values)
    keys = ["mean", "median", *(f"p{q}" for q in PERCENTILES[1:]), "min", "max"]
    if not xs:
        return dict.fromkeys(keys)
    stats = [sum(xs) / len(xs), *(percentile(xs, q) for q in PERCENTILES), min(xs), max(xs)]
    return dict(zip(keys, stats))


# ---- one run ----------------------------------------------------------------------------------
def goodput(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> float | None:
    """Requests per second that met `slo` (None when no SLO is given)."""
    if not slo.given:
        return None
    return sum(meets(r, slo) for r in records) / duration_s


def run_metrics(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO()
) -> dict[str, Any]:
    """Everything a run reports, from its records and duration (seconds, requests, tokens)."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_len if r.prompt_tokens is None else r.prompt_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tokens_short_of_max_tokens": sum(r.output_tokens < r.output_len for r in done),
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "goodput": goodput(records, duration_s, slo),
        "slo_met": sum(meets(r, slo) for r in records) if slo.given else None,
        "ttft_s": distribution(x for r in done if (x := ttft(r)) is not None),
        "tpot_s": distribution(x for r in done if (x := tpot(r)) is not None),
        "itl_s": distribution(x for r in done for x in itls(r)),
        "e2e_s": distribution(e2e(r) for r in done),
    }
