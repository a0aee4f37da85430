"""The summary of `python -m pdserve.bench.gpu_serve`: one row per system and request rate, and
each disaggregated system against the colocated server. Pure functions of the load generator's
runs (loadtest's report, `runs`), so they are tested without a server.

Ratios are disaggregated / the baseline (the colocated server on one GPU; the two colocated
replicas when the run has them): output tokens/s and goodput at the highest request rate
(saturation, `inf` by default; above 1 the split serves more) and the median TTFT at the lowest
(16 req/s by default; above 1 the split answers later), TPOT p99 at the highest; where a rate
was run several times (`--request-rate 16,inf,inf,inf`: three bursts), each side's mean over
them. Several calls' reports pooled (the same systems run in turns, colocated then split then
split then colocated, so that what drifts during a call weighs on both alike):

    python -m pdserve.bench.gpu_serve_table A/gpu_serve.json B/gpu_serve.json
    python -m pdserve.bench.gpu_serve_table A/gpu_serve.json#colocated C/gpu_serve.json

(`#SYSTEM` after a file: only that system's rows of it.)

A split's KV handover: the prefill worker's seconds from the first token to its push's commit
(`kv_transfer_first_token_to_commit_seconds`) per completed request, and its share of the
median time to the second token (the first comes from the prefill worker, the second needs the
KV on the decode worker).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from pdserve.bench.report import bench_main

COLUMNS = ("system", "rate", "done", "fail", "req/s", "goodput", "out tok/s", "TTFT p50",
           "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "2nd tok p50",
           "handover", "KV share")
LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
                "itl_p99_ms", "second_token_p50_ms", "handover_ms")
BASELINES = ("replicas", "colocated")  # the first the run has
HANDOVER = "pdserve:kv_transfer_first_token_to_commit_seconds_total"


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one loadtest run (one request rate); latencies in ms."""
    def ms(key: str, stat: str) -> float | None:
        value = (run.get(key) or {}).get(stat)
        return None if value is None else 1e3 * value

    return {
        "rate": run["request_rate"], "done": run["completed"], "fail": run["failed"],
        "req_s": run["request_throughput"], "goodput": run.get("goodput"),
        "out_tok_s": run["output_token_throughput"],
        "ttft_p50_ms": ms("ttft_s", "median"), "ttft_p99_ms": ms("ttft_s", "p99"),
        "tpot_p50_ms": ms("tpot_s", "median"), "tpot_p99_ms": ms("tpot_s", "p99"),
        "itl_p50_ms": ms("itl_s", "median"), "itl_p99_ms": ms("itl_s", "p99"),
        **handover(run),
    }


def handover(run: dict[str, Any]) -> dict[str, float | None]:
    """The KV handover per completed request (ms) and its share of the time to the second
    token; None where the run has no transfers (colocated)."""
    second = run.get("second_token_p50_s")
    pushed = sum(page.get(HANDOVER, 0.0) for page in (run.get("server_counters") or {}).values())
    ms = 1e3 * pushed / run["completed"] if pushed and run["completed"] else None
    share = ms / (1e3 * second) if ms is not None and second else None
    return {"second_token_p50_ms": None if second is None else 1e3 * second,
            "handover_ms": ms, "kv_share": share}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system its rows (from its `runs`) and what else it reported; the ratios."""
    systems = []
    for result in results:
        entry = {k: v for k, v in result.items() if k != "runs"}
        entry["rows"] = [run_row(r) for r in result.get("runs", [])]
        systems.append(entry)
    return {"systems": systems, "ratios": ratios(systems)}


def ratios(systems: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """system -> its figures over the colocated server's (see the module docstring); {} when
    the colocated server has no rows."""
    rows: dict[str, dict[float, dict[str, Any]]] = {}
    for s in systems:
        by_rate: dict[float, list[dict[str, Any]]] = {}
        for r in s["rows"]:
            by_rate.setdefault(r["rate"], []).append(r)
        if by_rate:
            mine = rows.setdefault(s["system"], {})
            for rate, runs in by_rate.items():
                mine[rate] = _mean_row(runs)
    baseline = baseline_of(rows)
    if baseline is None:
        return {}
    base = rows[baseline]
    high, low = max(base), min(base)
    out = {}
    for system, mine in rows.items():
        if system == baseline or high not in mine or low not in mine:
            continue
        out[system] = {
            "baseline": baseline, "saturation_rate": high, "ttft_rate": low,
            "out_tok_s": _ratio(mine[high]["out_tok_s"], base[high]["out_tok_s"]),
            "goodput": _ratio(mine[high]["goodput"], base[high]["goodput"]),
            "ttft_p50": _ratio(mine[low]["ttft_p50_ms"], base[low]["ttft_p50_ms"]),
            "tpot_p99": _ratio(mine[high]["tpot_p99_ms"], base[high]["tpot_p99_ms"]),
        }
    return out


def _mean_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios' figures averaged over runs at one rate (None if any run lacks one)."""
    keys = ("out_tok_s", "goodput", "ttft_p50_ms", "tpot_p99_ms")
    return {k: None if any(r.get(k) is None for r in runs) else
            sum(r[k] for r in runs) / len(runs) for k in keys}


def pooled(reports: list[dict[str, Any]], only: list[str | None] | None = None
           ) -> list[dict[str, Any]]:
    """The systems of several gpu_serve.json reports, each system's rows of every report
    together (in the reports' order); `only[i]`: report i's rows of that system alone."""
    systems: dict[str, dict[str, Any]] = {}
    for report, keep in zip(reports, only or [None] * len(reports), strict=True):
        for s in report["systems"]:
            if keep is not None and s["system"] != keep:
                continue
            entry = systems.setdefault(s["system"], {"system": s["system"], "rows": []})
            entry["rows"] += s.get("rows", [])
    return list(systems.values())


def baseline_of(rows: dict[str, Any]) -> str | None:
    """The system the others are compared with: the first of BASELINES the run has."""
    return next((b for b in BASELINES if rows.get(b)), None)


def _ratio(mine: float | None, base: float | None) -> float | None:
    return None if mine is None or not base else mine / base


# ---- text ----------------------------------------------------------------------------------------
def format_table(summary: dict[str, Any]) -> str:
    """The rows as a markdown table, the ratios, the KV bytes per data plane, and errors."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for s in summary["systems"]:
        for r in s["rows"]:
            cells = [s["system"], _rate(r["rate"]), str(r["done"]), str(r["fail"]),
                     _num(r["req_s"], ".2f"), _num(r["goodput"], ".2f"),
                     _num(r["out_tok_s"], ".0f"), *(_num(r.get(k), ".1f") for k in LATENCY_KEYS),
                     _num(r.get("kv_share"), ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "(ms; goodput: requests/s meeting both SLOs)", *_ratio_lines(summary["ratios"]),
              *_transfer_lines(summary["systems"])]
    errors = [f"{s['system']}: {s['error']} (log: {s.get('log', '-')})"
              for s in summary["systems"] if s.get("error")]
    return "\n".join(lines + ([""] + errors if errors else []))


def _ratio_lines(table: dict[str, dict[str, Any]]) -> list[str]:
    if not table:
        return []
    lines = [""]
    for system, r in table.items():
        sat, low = _rate(r["saturation_rate"]), _rate(r["ttft_rate"])
        lines.append(f"  {system} over {r['baseline']}: out tok/s at {sat} "
                     f"{_x(r['out_tok_s'])}, goodput at {sat} {_x(r['goodput'])}, TTFT p50 at "
                     f"{low} {_x(r['ttft_p50'])}, TPOT p99 at {sat} {_x(r.get('tpot_p99'))}")
    return lines


def _transfer_lines(systems: list[dict[str, Any]]) -> list[str]:
    lines = []
    for s in systems:
        for role, planes in sorted((s.get("kv_bytes_by_transport") or {}).items()):
            moved = ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in sorted(planes.items()))
            lines.append(f"  {s['system']} {role}: {moved or '-'}")
    return ["", "KV bytes per data plane (warm-ups included):", *lines] if lines else []


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", nargs="+",
                        help="gpu_serve.json files, each FILE or FILE#SYSTEM")


def run(args: argparse.Namespace) -> None:
    """Pool the gpu_serve.json reports named and print their rows and ratios."""
    named = [(path, keep or None) for path, _, keep in (r.partition("#") for r in args.reports)]
    systems = pooled([json.loads(Path(path).read_text()) for path, _ in named],
                     [keep for _, keep in named])
    print(format_table({"systems": systems, "ratios": ratios(systems)}))


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_serve_table", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
