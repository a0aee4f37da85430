"""The load test's report: a console table per sweep, the JSON file, and (loadtest/plots.py)
pictures. Latencies print in milliseconds; the JSON keeps seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    """Write `report` as indented JSON (creating the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def format_run(run: dict[str, Any]) -> str:
    """One run as a block of lines, vLLM `bench serve` style."""
    load = run.get("load_avg_1m") or [None, None]
    lines = [
        f"---- request rate {_rate(run['request_rate'])}/s ({run['arrival']}, burstiness "
        f"{run['burstiness']:g}, max concurrency {run['max_concurrency'] or '-'}) ----",
        f"completed / failed / not sent      {run['completed']} / {run['failed']} / "
        f"{run['not_sent']}{'  (stopped at --max-duration)' if run['timed_out'] else ''}",
        f"duration s                         {run['duration_s']:.2f}  (load average "
        f"{_num(load[0], '.1f')} -> {_num(load[1], '.1f')})",
        f"prompt / output tokens             {run['prompt_tokens']} / {run['output_tokens']}",
        f"request throughput req/s           {run['request_throughput']:.3f}",
        f"goodput req/s                      {_num(run['goodput'], '.3f')}",
        f"prefix hits / hittable tokens      {run.get('prefix_cache_hit_tokens', 0):.0f} / "
        f"{run.get('reused_prompt_tokens', 0)}  ({_num(run.get('prefix_hit_rate'), '.1%')})",
        f"output / total token throughput    {run['output_token_throughput']:.1f} / "
        f"{run['total_token_throughput']:.1f} tok/s",
        f"{'ms':<8}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, name in LATENCIES:
        d = run[key]
        lines.append(f"{name:<8}" + "".join(f"{_ms(d[k]):>10}"
                                             for k in ("mean", "median", "p90", "p99")))
    return "\n".join(lines)


SWEEP_COLUMNS = ("rate", "done", "fail", "req/s", "goodput", "out tok/s", "TTFT p50",
                 "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "E2E p50", "load")


def sweep_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row of strings per run: the sweep at a glance (latencies in ms)."""
    rows = []
    for run in report["runs"]:
        load = (run.get("load_avg_1m") or [None])[0]
        rows.append([
            _rate(run["request_rate"]), str(run["completed"]), str(run["failed"]),
            f"{run['request_throughput']:.3f}", _num(run["goodput"], ".3f"),
            f"{run['output_token_throughput']:.1f}",
            _ms(run["ttft_s"]["median"]), _ms(run["ttft_s"]["p99"]),
            _ms(run["tpot_s"]["median"]), _ms(run["tpot_s"]["p99"]),
            _ms(run["itl_s"]["median"]), _ms(run["e2e_s"]["median"]), _num(load, ".1f"),
        ])
    return rows


def format_sweep(report: dict[str, Any]) -> str:
    """Every run's block, then the sweep as one table."""
    widths = [max(len(c), 8) + 1 for c in SWEEP_COLUMNS]
    table = ["".join(f"{c:>{w}}" for c, w in zip(SWEEP_COLUMNS, widths))]
    table += ["".join(f"{v:>{w}}" for v, w in zip(row, widths)) for row in sweep_rows(report)]
    head = f"{report.get('label') or 'load test'}: {report['config']['base_url']} " \
           f"({report['config']['endpoint']}, model {report['model']})"
    return "\n\n".join([head, *map(format_run, report["runs"]), "\n".join(table)])


def markdown_table(reports: list[dict[str, Any]]) -> str:
    """Several reports side by side (one row per report and rate), as a markdown table."""
    columns = ("system", *SWEEP_COLUMNS)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for report in reports:
        for row in sweep_rows(report):
            lines.append("| " + " | ".join([report.get("label") or "-", *row]) + " |")
    return "\n".join(lines)
