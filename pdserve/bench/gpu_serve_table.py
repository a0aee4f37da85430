"""The summary of `python -m pdserve.bench.gpu_serve`: one row per system and request rate, and
each disaggregated system against the colocated server. Pure functions of the load generator's
runs (loadtest's report, `runs`), so they are tested without a server.

Ratios are disaggregated / colocated: output tokens/s and goodput at the highest request rate
(saturation, `inf` by default; above 1 the split serves more) and the median TTFT at the lowest
(16 req/s by default; above 1 the split answers later).
"""

from __future__ import annotations

import math
from typing import Any

COLUMNS = ("system", "rate", "done", "fail", "req/s", "goodput", "out tok/s", "TTFT p50",
           "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50")
LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms")
BASELINE = "colocated"


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
        "itl_p50_ms": ms("itl_s", "median"),
    }


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
    rows = {s["system"]: {r["rate"]: r for r in s["rows"]} for s in systems if s["rows"]}
    base = rows.get(BASELINE)
    if not base:
        return {}
    high, low = max(base), min(base)
    out = {}
    for system, mine in rows.items():
        if system == BASELINE or high not in mine or low not in mine:
            continue
        out[system] = {
            "saturation_rate": high, "ttft_rate": low,
            "out_tok_s": _ratio(mine[high]["out_tok_s"], base[high]["out_tok_s"]),
            "goodput": _ratio(mine[high]["goodput"], base[high]["goodput"]),
            "ttft_p50": _ratio(mine[low]["ttft_p50_ms"], base[low]["ttft_p50_ms"]),
        }
    return out


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
                     _num(r["out_tok_s"], ".0f"), *(_num(r[k], ".1f") for k in LATENCY_KEYS)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "(ms; goodput: requests/s meeting both SLOs)", *_ratio_lines(summary["ratios"]),
              *_transfer_lines(summary["systems"])]
    errors = [f"{s['system']}: {s['error']} (log: {s.get('log', '-')})"
              for s in summary["systems"] if s.get("error")]
    return "\n".join(lines + ([""] + errors if errors else []))


def _ratio_lines(table: dict[str, dict[str, Any]]) -> list[str]:
    if not table:
        return []
    lines = ["", f"over {BASELINE}:"]
    for system, r in table.items():
        sat, low = _rate(r["saturation_rate"]), _rate(r["ttft_rate"])
        lines.append(f"  {system}: out tok/s at {sat} {_x(r['out_tok_s'])}, goodput at {sat} "
                     f"{_x(r['goodput'])}, TTFT p50 at {low} {_x(r['ttft_p50'])}")
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
