"""Load test an OpenAI-compatible server (pdserve, vLLM, ...): streamed requests at a request
rate, TTFT / TPOT / ITL / E2E percentiles, throughput and goodput.

    python -m loadtest --base-url http://127.0.0.1:8000 --request-rate 0.5,1,2 \\
        --num-prompts 50 --input-len 128-256 --output-len 32-64 --slo-ttft-ms 2000 \\
        --slo-tpot-ms 200                                  # = pdserve bench serve ...
    python -m loadtest --endpoint chat --workload synthetic --request-rate inf \\
        --max-concurrency 8
    python -m loadtest.compare A.json B.json               # reports side by side (markdown)

Random prompts are exact in length with the server's tokenizer (--tokenizer: a local HF folder
or .gguf; default pdserve's bundled model), and go to /v1/completions as token ids
(--prompt-format text sends their text). Output lengths are held with `ignore_eos`
(--no-ignore-eos for servers that refuse it). The same --seed sends the same requests at the
same offsets. Everything stays on the URL given: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
from typing import Any

import httpx

from loadtest import arrivals, workloads
from loadtest.client import ENDPOINTS, ClientConfig, StreamClient
from loadtest.metrics import SLO
from loadtest.report import format_sweep, write_json
from loadtest.runner import RunConfig, sweep


def parse_len(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '128-256' -> (128, 256), both ends included."""
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a length is N or LOW-HIGH, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"a length needs 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.5,1,inf' -> (0.5, 1.0, inf)."""
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The load test's options (shared by `pdserve bench serve`)."""
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server; several, comma-separated, take requests in turn")
    s.add_argument("--endpoint", default="completions", choices=sorted(ENDPOINTS))
    s.add_argument("--model", default="", help="default: the server's first model")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    s.add_argument("--tokenizer", default=None,
                   help="local HF folder or .gguf (default: pdserve's bundled model)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="random", choices=workloads.KINDS)
    w.add_argument("--input-len", type=parse_len, default=(128, 256), metavar="N|LO-HI",
                   help="prompt tokens (shared-prefix: the part after the prefix)")
    w.add_argument("--output-len", type=parse_len, default=(32, 64), metavar="N|LO-HI")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts")
    w.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: their tokens; multi-turn: the system prompt's")
    w.add_argument("--num-conversations", type=int, default=8,
                   help="multi-turn: conversations interleaved")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--dataset-path", default="", help="sharegpt: a ShareGPT-format JSON file")
    w.add_argument("--max-len", type=int, default=2048,
                   help="sharegpt/synthetic: skip longer conversations (prompt + reply)")
    w.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt/synthetic: this output length instead of the reply's")
    w.add_argument("--prompt-format", default="ids", choices=["ids", "text"],
                   help="completions: send token ids (where known) or text")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--logprobs", action="store_true",
                   help="ask for logprobs, so each chunk's token count is known")
    w.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into requests")
    r = p.add_argument_group("load")
    r.add_argument("--num-prompts", type=int, default=100, help="requests per request rate")
    r.add_argument("--request-rate", type=parse_rates, default=(math.inf,), metavar="R[,R..]",
                   help="requests/s, a sweep when several (inf: all at once)")
    r.add_argument("--arrival", default="poisson", choices=arrivals.KINDS)
    r.add_argument("--burstiness", type=float, default=1.0,
                   help="poisson: gamma shape of the gaps (1: Poisson; < 1 burstier)")
    r.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (per client process)")
    r.add_argument("--client-processes", type=int, default=1,
                   help="send from this many processes (one process's client can be the "
                        "bound at high rates: loadtest/processes.py)")
    r.add_argument("--num-warmups", type=int, default=1)
    r.add_argument("--max-duration", type=float, default=600.0, help="seconds per rate")
    r.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--slo-ttft-ms", type=float, default=None)
    r.add_argument("--slo-tpot-ms", type=float, default=None)
    r.add_argument("--metrics-url", action="append", default=[],
                   help="a Prometheus /metrics page whose counters each run reports (repeat)")
    o = p.add_argument_group("report")
    o.add_argument("--label", default="", help="names this run in tables and plots")
    o.add_argument("--output-json", default="bench_results/serve.json")
    o.add_argument("--plot-dir", default=None, help="default: beside the JSON")
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--no-progress", dest="progress", action="store_false")


def configs(args: argparse.Namespace) -> tuple[workloads.WorkloadConfig, ClientConfig, RunConfig]:
    """The three configs of a run, from parsed `args`. Raises ValueError."""
    slo = SLO(None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
              None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3)
    work = workloads.WorkloadConfig(
        args.workload, args.input_len, args.output_len, args.num_prefixes, args.prefix_len,
        args.dataset_path, args.max_len, args.sharegpt_output_len, args.num_conversations,
        args.num_turns)
    client = ClientConfig(
        args.base_url, args.endpoint, args.model, args.prompt_format, args.ignore_eos,
        args.temperature, args.logprobs, args.extra_body, args.api_key, args.request_timeout)
    run = RunConfig(args.request_rate, args.num_prompts, args.arrival, args.burstiness,
                    args.max_concurrency, args.num_warmups, args.max_duration, args.seed, slo,
                    args.progress, tuple(args.metrics_url), args.client_processes)
    return work, client, run


async def measure(client_cfg: ClientConfig, specs: list[workloads.RequestSpec],
                  run_cfg: RunConfig) -> tuple[str, list[dict[str, Any]]]:
    async with StreamClient(client_cfg, run_cfg.max_concurrency) as client:
        return client.model, await sweep(client, specs, run_cfg)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload, run the sweep, print the tables, write JSON and plots; the report."""
    work_cfg, client_cfg, run_cfg = configs(args)
    from loadtest.tokens import load_tokenizer

    started = time.time()
    tokenizer = load_tokenizer(args.tokenizer)
    specs = workloads.build(work_cfg, tokenizer, run_cfg.total_requests, args.seed)
    model, runs = asyncio.run(measure(client_cfg, specs, run_cfg))
    report = {
        "label": args.label, "model": model, "started_at": started,
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
        "environment": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
        "runs": runs,
    }
    print(format_sweep(report))
    path = write_json(report, args.output_json)
    print(f"wrote {path}")
    if args.plots:
        from loadtest.plots import write_plots

        for p in write_plots(report, args.plot_dir or path.parent, path.stem):
            print(f"wrote {p}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, RuntimeError) as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"loadtest: error: {args.base_url}: {exc}", file=sys.stderr)
        return 1
    return 0
