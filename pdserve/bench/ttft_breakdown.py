"""Where a split cluster's first tokens waited: a load test's report against the cluster's log.

    python -m pdserve.bench.ttft_breakdown LOADTEST_JSON CLUSTER_LOG [--run -1] [--brief]

For each request of the run (the report's `runs[--run]`), read from the log of `pdserve up`
(gpu_serve's `cluster_<system>.log`) the gateway's "finished in S" line (S counts from the
request's arrival in the gateway's handler) and the prefill worker's "prefilled" line, and
split the client's time to first token into:

  before the handler   the client's end-to-end time minus the gateway's: the load generator's
                       send, the connection and FastAPI's parsing (and the client reading the
                       last bytes, a few ms)
  handler -> prefilled the gateway's tokenize, Redis, routing and reservation, the wait in the
                       prefill worker's queue and its step (handler start = the gateway's log
                       time minus S; both clocks are the host's)
  the rest             the first token's way back to the client

(handler -> first token: the two above together; the only split of a request no prefill
worker logged: a colocated server's log, or a prompt prefilled on the decode worker.)

Where the gateway logged the attempt's "first token in T ms: route R, reserve V, prefill P"
(gateway/remote_backend.py) and the prefill worker its time on the "prefilled" line, the
handler's part splits further:

  before the attempt   tokenize (the tokenizer service), admission, the request's state record
  route                the registry's and the prefix index's reads
  reserve              the decode worker's reservation: Generate's first message (with
                       "beside", the Prefill call went out at once, not after it: the parts
                       overlap and no longer add up to the handler's time)
  prefill worker       the Prefill handler's own time to the first token (engine and its step)
  prefill call rest    the Prefill call's way there and back, around the worker's own time:
                       there (the gateway's send to the handler's start) and back (the
                       handler's "prefilled" line to the gateway's answer), where both logged
                       their monotonic times (one clock for the host's processes)

the reservation by the decode worker's own time from its Generate to the blocks reserved
(decode reserve, on its "KV received" line; reserve call rest: the call's way there, the
stream's first message back), and the prefill worker's time by its engine's milestones (same
host, one clock): into the
engine (the handler to the engine's arrival: in a process of its own, the pipe), engine
waiting (for a step to take it), engine steps (scheduled to its first token), engine back
(the token's way out of the engine and to the handler).

Prints the medians (and p90) of each part and the prefill worker's steps during the run
(completions less than 5 ms apart are one step); `--brief`: one line of the medians. The log's
times have millisecond resolution (the parts measured in-process, route to prefill call rest,
have 0.1 ms).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from pdserve.bench.report import bench_main

_TIME = re.compile(r"(\d\d):(\d\d):(\d\d),(\d\d\d)")
_FINISHED = re.compile(r"(cmpl-[0-9a-f]+|chatcmpl-[0-9a-f]+): \w+ in ([0-9.]+)s")
_PREFILLED = re.compile(r"\[((?:chat)?cmpl-[0-9a-f]+)\] prefilled (?:.*? in ([0-9.]+) ms"
                        r"(?: \(into the engine ([-0-9.]+), waiting ([0-9.]+), steps ([0-9.]+), "
                        r"back ([-0-9.]+)\))?(?: at ([0-9.]+))?,)?")
_ENGINE_PARTS = ("into_engine", "engine_waiting", "engine_steps", "engine_back")
_RESERVED = re.compile(r"\[((?:chat)?cmpl-[0-9a-f]+)\] KV received: .*\(reserved in ([0-9.]+) ms\)")
_FIRST = re.compile(r"\[((?:chat)?cmpl-[0-9a-f]+)\] first token in ([0-9.]+) ms: route ([0-9.]+), "
                    r"reserve ([0-9.]+)(?: beside)?, prefill ([0-9.]+)"
                    r"(?: \(call at ([0-9.]+)-([0-9.]+)\))?")
STEP_GAP_S = 0.005


def _seconds(line: str) -> float | None:
    m = _TIME.search(line)
    if m is None:
        return None
    h, mi, s, ms = map(int, m.groups())
    return h * 3600 + mi * 60 + s + ms / 1000


def read_log(path: Path) -> tuple[dict[str, tuple[float, float]], dict[str, float],
                                   dict[str, dict[str, float]]]:
    """({request id: (gateway log time, its elapsed s)}, {request id: prefilled log time},
    {request id: the attempt's parts in s, where logged: "attempt_at" (its start, log clock),
    "route", "reserve", "prefill_call", "prefill_worker"})."""
    finished: dict[str, tuple[float, float]] = {}
    prefilled: dict[str, float] = {}
    phases: dict[str, dict[str, float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        t = _seconds(line)
        if t is None:
            continue
        if (m := _FINISHED.search(line)) and line.startswith("[gateway"):
            finished[m.group(1)] = (t, float(m.group(2)))
        elif m := _FIRST.search(line):
            total, route, reserve, call = (float(g) / 1e3 for g in m.groups()[1:5])
            phases.setdefault(m.group(1), {}).update(
                attempt_at=t - total, route=route, reserve=reserve, prefill_call=call)
            if m.group(6) is not None:  # the call's sent and answered times (monotonic)
                phases[m.group(1)].update(call_sent=float(m.group(6)),
                                          call_answered=float(m.group(7)))
        elif m := _RESERVED.search(line):
            phases.setdefault(m.group(1), {})["decode_reserve"] = float(m.group(2)) / 1e3
        elif m := _PREFILLED.search(line):
            prefilled[m.group(1)] = t
            if m.group(2) is not None:
                phases.setdefault(m.group(1), {})["prefill_worker"] = float(m.group(2)) / 1e3
            if m.group(3) is not None:
                phases[m.group(1)].update(
                    {k: float(v) / 1e3 for k, v in zip(_ENGINE_PARTS, m.groups()[2:6])})
            if m.group(7) is not None:  # the handler's start (monotonic)
                phases.setdefault(m.group(1), {})["handler_at"] = float(m.group(7))
    return finished, prefilled, phases


def breakdown(report: dict, finished: dict, prefilled: dict, run: int = -1,
              phases: dict | None = None) -> dict:
    parts: dict[str, list[float]] = {"ttft": [], "before_handler": [],
                                     "handler_to_first_token": []}
    done_at = []
    for req in report["runs"][run]["requests"]:
        rid = req.get("request_id")
        if rid not in finished or not req.get("chunk_at"):
            continue
        ttft = req["chunk_at"][0] - req["sent_at"]
        logged, elapsed = finished[rid]
        before = (req["done_at"] - req["sent_at"]) - elapsed
        values = [("ttft", ttft), ("before_handler", before),
                  ("handler_to_first_token", ttft - before)]
        if rid in prefilled:  # else a colocated server's, or prefilled on the decode worker
            values += _split_parts(ttft - before, logged - elapsed, prefilled[rid],
                                   (phases or {}).get(rid, {}))
            done_at.append(prefilled[rid])
        for key, value in values:
            parts.setdefault(key, []).append(value)
    counted = len(parts["ttft"])
    if not counted:
        raise ValueError("no request of the run is in the log (wrong log or run?)")
    return {"requests": counted,
            "ms": {k: {"p50": round(1e3 * statistics.median(v), 1), "p90": quantile_ms(v, 0.9),
                       **({"requests": len(v)} if len(v) != counted else {})}
                   for k, v in parts.items()},
            **({"prefill_steps": _steps(sorted(done_at))} if done_at else {})}


def _split_parts(to_first: float, handler_at: float, prefilled_at: float,
                 p: dict[str, float]) -> list[tuple[str, float]]:
    """A split request's handler-to-first-token time `to_first` by the prefill worker's
    "prefilled" log time and the attempt's logged parts `p` (all in s)."""
    to_prefilled = prefilled_at - handler_at
    values = [("handler_to_prefilled", to_prefilled), ("rest", to_first - to_prefilled)]
    if "attempt_at" in p and "prefill_worker" in p:
        values += [("before_attempt", p["attempt_at"] - handler_at),
                   ("route", p["route"]), ("reserve", p["reserve"]),
                   ("prefill_worker", p["prefill_worker"]),
                   ("prefill_call_rest", p["prefill_call"] - p["prefill_worker"])]
        values += [(k, p[k]) for k in _ENGINE_PARTS if k in p]
        if "call_sent" in p and "handler_at" in p:
            values += [("prefill_call_there", p["handler_at"] - p["call_sent"]),
                       ("prefill_call_back", p["call_answered"] - p["handler_at"]
                        - p["prefill_worker"])]
        if "decode_reserve" in p:
            values += [("decode_reserve", p["decode_reserve"]),
                       ("reserve_call_rest", p["reserve"] - p["decode_reserve"])]
    return values


def quantile_ms(values: list[float], q: float) -> float:
    """The nearest-rank quantile, in ms."""
    ordered = sorted(values)
    return round(1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def _steps(times: list[float]) -> dict:
    """The prefill worker's completions grouped into steps: sizes and gaps between them."""
    groups = [[times[0]]]
    for t in times[1:]:
        if t - groups[-1][-1] > STEP_GAP_S:
            groups.append([])
        groups[-1].append(t)
    starts = [g[0] for g in groups]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    return {"span_ms": round(1e3 * (times[-1] - times[0]), 1), "count": len(groups),
            "prompts": [len(g) for g in groups],
            "gap_ms": [round(1e3 * gap, 1) for gap in gaps],
            "median_gap_ms": round(1e3 * statistics.median(gaps or [0.0]), 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", type=Path, help="the load generator's --output-json")
    p.add_argument("log", type=Path, help="the cluster's log (pdserve up's output)")
    p.add_argument("--run", type=int, default=-1, help="which of the report's runs (rates)")
    p.add_argument("--brief", action="store_true", help="one line: each part's median (ms)")


def run(args: argparse.Namespace) -> dict:
    finished, prefilled, phases = read_log(args.log)
    try:
        result = breakdown(json.loads(args.report.read_text()), finished, prefilled, args.run,
                           phases)
    except (IndexError, KeyError) as exc:
        raise ValueError(f"{args.report} is not a load test report with run {args.run}: "
                         f"{exc!r}") from exc
    if args.brief:
        print(" ".join(f"{k} {v['p50']}" for k, v in result["ms"].items()))
    else:
        print(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    return bench_main("ttft_breakdown", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
