"""Where a load test's requests were, moment by moment: the stages of a burst over time.

    python -m pdserve.bench.burst_timeline LOADTEST_JSON [CLUSTER_LOG] [--run -1] [--bin-ms 25]

NOTE: every request of the run (the report's `runs[--run]`, its times on the load generator's
clock) is in one stage at each moment:

  before first token   sent, no token back yet; with the cluster's log (pdserve up's output,
                       gpu_serve's `cluster_<system>.log`) split at the prefill worker's
                       "prefilled" line into `to prefill` (the gateway, the prefill queue, the
                       step) and `to client` (the first token's way back)
  handover             the first token received, the second not yet (the split: the KV's
                       commit and the request's first decode step; colocated: its first
                       decode step)
  decoding             the second token received, not done

Per bin of --bin-ms: the count in each stage (at the bin's middle), the tokens that reached
clients during the bin, and the decode step that rate implies: bin / (tokens / streams
decoding), where every decoding stream gets one token a step (greedy, no speculation). The
summary splits the decode steps into those while prompts were still being prefilled (until the
last first token) and those after: on one GPU shared by two workers, the first show the
prefill worker's kernels time-sliced in, the second the decode worker alone.

The log's times are wall clock (ms); they are put on the report's clock by the median offset
of the gateway's "finished" lines from the requests' done times (the client reads the last
bytes a few ms after the gateway logs).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.report import bench_main
from pdserve.bench.ttft_breakdown import quantile_ms, read_log

_RECEIVED = re.compile(r"\[((?:chat)?cmpl-[0-9a-f]+)\] KV received: ")


@dataclass
class Trip:
    """One request's moments on the report's clock (s); prefilled is None without a log."""

    sent: float
    first: float
    second: float
    done: float
    prefilled: float | None = None


def trips(report: dict, run: int, log: Path | None) -> list[Trip]:
    requests = [r for r in report["runs"][run]["requests"]
                if not r.get("error") and len(r.get("chunk_at") or []) >= 2]
    if not requests:
        raise ValueError("no finished request with two chunks in that run")
    out = [Trip(r["sent_at"], r["chunk_at"][0], r["chunk_at"][1], r["done_at"])
           for r in requests]
    if log is None:
        return out
    finished, prefilled, _ = read_log(log)
    offsets = [finished[r["request_id"]][0] - r["done_at"]
               for r in requests if r.get("request_id") in finished]
    if not offsets:
        raise ValueError(f"no request of the run finished in {log}")
    offset = statistics.median(offsets)
    for trip, r in zip(out, requests):
        if r.get("request_id") in prefilled:
            trip.prefilled = prefilled[r["request_id"]] - offset
    return out


def tokens_per_bin(report: dict, run: int, bins: int, bin_s: float, t0: float) -> list[int]:
    counts = [0] * bins
    for r in report["runs"][run]["requests"]:
        sizes = r.get("chunk_tokens") or [1] * len(r.get("chunk_at") or [])
        for at, n in zip(r.get("chunk_at") or [], sizes):
            i = int((at - t0) / bin_s)
            if 0 <= i < bins:
                counts[i] += n
    return counts


def stage_counts(trips_: list[Trip], t: float) -> dict[str, int]:
    c = {"to_prefill": 0, "to_client": 0, "handover": 0, "decoding": 0}
    for trip in trips_:
        if trip.sent > t or trip.done <= t:
            continue
        if t < trip.first:
            split = trip.prefilled is not None and trip.prefilled <= t
            c["to_client" if split else "to_prefill"] += 1
        elif t < trip.second:
            c["handover"] += 1
        else:
            c["decoding"] += 1
    return c


def timeline(report: dict, run: int, log: Path | None, bin_ms: float) -> dict:
    ts = trips(report, run, log)
    bin_s = bin_ms / 1e3
    t0 = min(t.sent for t in ts)
    end = max(t.done for t in ts)
    bins = int((end - t0) / bin_s) + 1
    tokens = tokens_per_bin(report, run, bins, bin_s, t0)
    last_first = max(t.first for t in ts)
    rows, during, after = [], [], []
    for i in range(bins):
        mid = t0 + (i + 0.5) * bin_s
        stages = stage_counts(ts, mid)
        step_ms = (bin_ms * stages["decoding"] / tokens[i]
                   if tokens[i] and stages["decoding"] else None)
        rows.append({"t_ms": round(1e3 * (mid - t0)), **stages, "tokens": tokens[i],
                     "step_ms": None if step_ms is None else round(step_ms, 2)})
        if step_ms is not None and stages["decoding"] >= 8:
            (during if mid < last_first else after).append((step_ms, stages["decoding"]))
    return {"requests": len(ts), "span_ms": round(1e3 * (end - t0)),
            "last_first_token_ms": round(1e3 * (last_first - t0)),
            "prefilled_span_ms": _span([t.prefilled for t in ts], t0),
            "first_token_ms": _quantiles([t.first - t.sent for t in ts]),
            "handover_ms": _quantiles([t.second - t.first for t in ts]),
            "prefill_to_client_ms": _quantiles([t.first - t.prefilled for t in ts
                                                if t.prefilled is not None]),
            "decode_while_prefilling": _steps(during), "decode_after": _steps(after),
            "bins": rows}


def _span(values: list[float | None], t0: float) -> list[int] | None:
    known = [v for v in values if v is not None]
    return [round(1e3 * (min(known) - t0)), round(1e3 * (max(known) - t0))] if known else None


def _quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    return {f"p{round(100 * q)}": quantile_ms(values, q) for q in (0.1, 0.5, 0.9)}


def _steps(samples: list[tuple[float, int]]) -> dict | None:
    """Median step ms and streams over the bins with at least 8 streams decoding."""
    if not samples:
        return None
    return {"bins": len(samples), "step_ms_p50": round(statistics.median(s for s, _ in samples), 2),
            "streams_p50": statistics.median(n for _, n in samples)}


def print_table(result: dict) -> None:
    print("  t ms  to prefill  to client  handover  decoding  tokens  step ms")
    for r in result["bins"]:
        step = "-" if r["step_ms"] is None else f"{r['step_ms']:.2f}"
        print(f"{r['t_ms']:6d}  {r['to_prefill']:10d}  {r['to_client']:9d}  {r['handover']:8d}"
              f"  {r['decoding']:8d}  {r['tokens']:6d}  {step:>7}")
    for key in ("requests", "span_ms", "last_first_token_ms", "prefilled_span_ms",
                "first_token_ms", "prefill_to_client_ms", "handover_ms",
                "decode_while_prefilling", "decode_after"):
        print(f"{key}: {result[key]}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", type=Path, help="the load generator's --output-json")
    p.add_argument("log", type=Path, nargs="?", help="the cluster's log (pdserve up's output)")
    p.add_argument("--run", type=int, default=-1, help="which of the report's runs (rates)")
    p.add_argument("--bin-ms", type=float, default=25.0, help="the timeline's bin")


def run(args: argparse.Namespace) -> dict:
    if args.bin_ms <= 0:
        raise ValueError("--bin-ms must be positive")
    try:
        result = timeline(json.loads(args.report.read_text()), args.run, args.log, args.bin_ms)
    except (IndexError, KeyError) as exc:
        raise ValueError(f"{args.report} is not a load test report with run {args.run}: "
                         f"{exc!r}") from exc
    print_table(result)
    return result


def main(argv: list[str] | None = None) -> int:
    return bench_main("burst_timeline", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
