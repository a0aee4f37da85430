"""PNG pictures of a report, for people who'd rather look than read (matplotlib, if installed).

    python -m loadtest.plots REPORT.json [OUT_DIR]     # again, from a saved report

  <stem>_latency_cdf.png   CDFs of TTFT, TPOT, ITL and E2E, one line per request rate
  <stem>_throughput.png    request throughput and goodput (req/s) and output tokens/s against
                           the offered request rate
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from loadtest import metrics
from loadtest.record import RequestRecord
from loadtest.report import load_json

MISSING = "plots skipped: matplotlib is not installed (pip install matplotlib)"


def _pyplot() -> Any | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def latency_samples(run: dict[str, Any]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2E and per-chunk ITL of a run's completed requests (ms)."""
    done = [r for r in map(RequestRecord.from_json, run["requests"]) if r.ok]
    samples = {
        "TTFT": [metrics.ttft(r) for r in done],
        "TPOT": [metrics.tpot(r) for r in done],
        "ITL": [x for r in done for x in metrics.itls(r)],
        "E2E": [metrics.e2e(r) for r in done],
    }
    return {k: sorted(1e3 * x for x in v if x is not None) for k, v in samples.items()}


def _label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_latency_cdfs(plt: Any, report: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for run in report["runs"]:
        for ax, xs in zip(axes.flat, latency_samples(run).values()):
            if xs:
                ys = [0.0, *((i + 1) / len(xs) for i in range(len(xs)))]
                ax.step([xs[0], *xs], ys, where="post",
                        label=f"{_label(run['request_rate'])} req/s")
    slo = {"TTFT": report["config"].get("slo_ttft_ms"), "TPOT": report["config"].get("slo_tpot_ms")}
    for ax, name in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E")):
        if slo.get(name) is not None:
            ax.axvline(slo[name], color="red", linestyle=":", label="SLO")
        ax.set(title=name, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        if name == "ITL" and ax.has_data():  # a long tail: log scale
            ax.set(xscale="log", xlabel="ms (log scale)", ylabel="fraction of chunk gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{report.get('label') or 'load test'}: latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(plt: Any, report: dict[str, Any], path: Path) -> None:
    runs = report["runs"]
    xs = list(range(len(runs)))
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(xs, [r["request_throughput"] for r in runs], "o-", label="request throughput")
    if any(r["goodput"] is not None for r in runs):
        ax.plot(xs, [r["goodput"] or 0 for r in runs], "s--", label="goodput (met the SLOs)")
    ax.set(xlabel="offered request rate (req/s)", ylabel="req/s", ylim=(0, None))
    ax.set_xticks(xs, [_label(r["request_rate"]) for r in runs])
    ax.grid(alpha=0.3)
    tokens = ax.twinx()
    tokens.plot(xs, [r["output_token_throughput"] for r in runs], "^:", color="tab:green",
                label="output tokens/s")
    tokens.set(ylabel="output tokens/s", ylim=(0, None))
    handles = ax.get_legend_handles_labels()
    extra = tokens.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper left", fontsize="small")
    ax.set_title(f"{report.get('label') or 'load test'}: throughput and goodput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(report: dict[str, Any], out_dir: str | Path, stem: str) -> list[Path]:
    """Both pictures into `out_dir`; [] (and a message) when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        print(MISSING, file=sys.stderr)
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}_latency_cdf.png", out / f"{stem}_throughput.png"]
    plot_latency_cdfs(plt, report, paths[0])
    plot_throughput(plt, report, paths[1])
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m loadtest.plots REPORT.json [OUT_DIR]", file=sys.stderr)
        return 2
    path = Path(args[0])
    for p in write_plots(load_json(path), args[1] if len(args) > 1 else path.parent, path.stem):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
