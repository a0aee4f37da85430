"""KV-aware routing against load routing on the same multi-turn load, in one command.

    python -m pdserve.bench.kv_routing [--routings kv_aware,load] [--out-dir DIR]
    pdserve bench kv-routing ...                          # the same
    # the defaults: 2 prefill + 1 decode workers, 48 requests at 1.6/s, 5 conversations of
    # 6 turns after a 256-token system prompt, 96-160-token user turns, 32-token replies
    python -m pdserve.bench.kv_routing --num-prompts 6 --num-conversations 2 --num-turns 3 \\
        --prefix-len 32 --input-len 16 --output-len 4    # a quick dry run

NOTE: what runs, each routing alone on the machine, in turn:

  cluster  `pdserve up --prefill P --decode D --routing ROUTING` on --model (default: the
           bundled SmolLM2), its own Redis, --kv-cache-memory per worker, a free --port; ready
           when /ready answers 200. The workers' metrics addresses come from /workers.
  load     `python -m loadtest --workload multi-turn` in a child process: --num-conversations
           conversations interleaved, --num-turns turns each, after one --prefix-len system
           prompt; each turn a --input-len user message, --output-len tokens out (ignore_eos,
           greedy); Poisson arrivals at --request-rate, no warm-up. The prefill workers' /metrics
           are its --metrics-url pages, so its report's prefix hit rate is the prefill workers'
           hits over the tokens an earlier turn sent (what a cache could hit).
  kv       the decode workers' counters around the load: KV bytes pushed to them and blocks not
           pushed because their prefix cache held them (decode-side reuse), in bytes through
           the model's KV layout (layers x 2 x block size x KV heads x head dim x dtype bytes).
  routing  the gateway's routing decisions (pdserve:routing_decisions_total by role, reason).
  stop     SIGTERM to `pdserve up`; wait.

Targets (docs/benchmarks.md, "KV-aware routing"): kv_aware's prefill hit rate >= 0.8 of the
hittable tokens (load routing: about 1/P), its TTFT p50 >= 2x lower than load routing's, and
decode-side reuse pushing >= 50% fewer KV bytes per turn than the turns' whole KV.

Into --out-dir: loadtest_ROUTING.json (every request's timeline), cluster_ROUTING.log and
kv_routing.json (config, per-routing rows, ratios), rewritten after each routing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.scrape import parse_counters
from pdserve.bench.gpu_serve import own_group, stop
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.launcher import Service, wait_healthy
from pdserve.ports import free_port

KV_COUNTERS = ("pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_skipped_blocks_total",
               "pdserve:kv_transfers_total")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routings", default="kv_aware,load", help="compared, in this order")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes per worker")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--request-rate", default="1.6", help="requests/s (inf: all at once)")
    p.add_argument("--num-conversations", type=int, default=5)
    p.add_argument("--num-turns", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=256, help="the shared system prompt")
    p.add_argument("--input-len", default="96-160", help="each user message")
    p.add_argument("--output-len", default="32", help="each reply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", default="bench_results/kv_routing")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every routing in turn; the summary JSON after each; the comparison last."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed run still stops its servers
    block_bytes = kv_block_bytes(args.model, args.dtype)
    rows = []
    for routing in [r.strip() for r in args.routings.split(",") if r.strip()]:
        print(f"== {routing}", flush=True)
        rows.append(run_routing(args, routing, out_dir, block_bytes))
        summary = {"config": config_of(args), "kv_block_bytes": block_bytes, "rows": rows,
                   "ratios": ratios(rows)}
        write_report(summary, str(out_dir / "kv_routing.json"))
    print(format_rows(rows, summary["ratios"]), flush=True)
    return summary


def run_routing(args: argparse.Namespace, routing: str, out_dir: Path,
                block_bytes: int) -> dict[str, Any]:
    """One cluster with `routing` under the load: its row of the comparison."""
    port, report = free_port(), out_dir / f"loadtest_{routing}.json"
    base_url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    with open(out_dir / f"cluster_{routing}.log", "w") as log, \
            tempfile.TemporaryDirectory(prefix="pdserve-kv-routing-") as tmp:
        env = {**os.environ, "PDSERVE_CLUSTER_FILE": str(Path(tmp) / "cluster.json")}
        try:
            procs.append(subprocess.Popen(up_argv(args, routing, port), stdout=log,
                                          stderr=subprocess.STDOUT, env=env, **own_group()))
            wait_healthy(Service("pdserve up", [], f"http:{base_url}/ready", procs[-1]),
                         time.monotonic() + args.startup_timeout)
            workers = worker_pages(base_url, args.prefill + args.decode)
            decode_before = _sum_pages(workers["decode"])
            code = subprocess.run(loadtest_argv(args, base_url, workers["prefill"],
                                                report)).returncode
            decode_after = _sum_pages(workers["decode"])
            decisions = routing_decisions(base_url)
        finally:
            stop(procs)
    if code != 0:
        return {"routing": routing, "error": f"loadtest exited with code {code}"}
    (load,) = json.loads(report.read_text())["runs"]
    kv = {k: decode_after.get(k, 0.0) - decode_before.get(k, 0.0) for k in KV_COUNTERS}
    return row(routing, load, kv, decisions, block_bytes)


def up_argv(args: argparse.Namespace, routing: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--prefill", str(args.prefill),
            "--decode", str(args.decode), "--routing", routing, "--dtype", args.dtype,
            "--kv-cache-memory", str(args.kv_cache_memory), "--max-model-len",
            str(args.max_model_len), "--port", str(port),
            "--local-prefill-max-tokens", "0"]
    return argv + (["--model", args.model] if args.model else [])


def loadtest_argv(args: argparse.Namespace, base_url: str, metrics: list[str],
                  output_json: Path) -> list[str]:
    argv = [sys.executable, "-m", "loadtest", "--base-url", base_url, "--workload",
            "multi-turn", "--num-conversations", str(args.num_conversations), "--num-turns",
            str(args.num_turns), "--prefix-len", str(args.prefix_len), "--input-len",
            args.input_len, "--output-len", args.output_len, "--request-rate", args.request_rate,
            "--num-prompts", str(args.num_prompts), "--num-warmups", "0", "--seed",
            str(args.seed), "--output-json", str(output_json), "--no-plots", "--no-progress"]
    if args.model:
        argv += ["--tokenizer", args.model]
    for url in metrics:
        argv += ["--metrics-url", url]
    return argv


def worker_pages(base_url: str, expected: int, timeout_s: float = 30.0) -> dict[str, list[str]]:
    """role -> the /metrics URLs of its workers, once `expected` workers are listed."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{base_url}/workers", timeout=10) as r:
            listed = [w for w in json.loads(r.read())["workers"] if w.get("metrics_address")]
        pages: dict[str, list[str]] = {"prefill": [], "decode": []}
        for w in listed:
            if w["role"] in pages:
                pages[w["role"]].append(f"http://{w['metrics_address']}/metrics")
        if len(listed) >= expected or time.monotonic() > deadline:
            return pages
        time.sleep(0.5)


def routing_decisions(base_url: str) -> dict[str, float]:
    """"role:reason" -> requests the gateway routed so."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.labels['role']}:{s.labels['reason']}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "pdserve:routing_decisions_total"}


def _sum_pages(urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:
            for name, value in parse_counters(r.read().decode()).items():
                total[name] = total.get(name, 0.0) + value
    return total


def kv_block_bytes(model: str | None, dtype: str) -> int:
    """Bytes of one KV block of every layer: layers x 2 x block size x KV heads x head dim x
    the dtype's size (the engine's default block size, 16)."""
    from engine.model_loader import load_hf_config, resolve_model

    config = load_hf_config(resolve_model(model))
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return config.num_hidden_layers * 2 * 16 * config.num_key_value_heads * head_dim * elem


def row(routing: str, load: dict[str, Any], kv: dict[str, float], decisions: dict[str, float],
        block_bytes: int) -> dict[str, Any]:
    """One routing's figures: latencies (s), hit rate, KV bytes per turn pushed and held."""
    turns = max(kv["pdserve:kv_transfers_total"], 1.0)
    pushed = kv["pdserve:kv_transfer_bytes_total"]
    held = kv["pdserve:kv_transfer_skipped_blocks_total"] * block_bytes
    return {
        "routing": routing, "completed": load["completed"], "failed": load["failed"],
        "ttft_p50_s": load["ttft_s"]["median"], "ttft_p99_s": load["ttft_s"]["p99"],
        "tpot_p50_s": load["tpot_s"]["median"], "output_tok_s": load["output_token_throughput"],
        "prefill_hit_rate": load.get("prefix_hit_rate"),
        "hittable_tokens": load.get("reused_prompt_tokens"),
        "prefill_hit_tokens": load.get("prefix_cache_hit_tokens"),
        "kv_pushed_bytes_per_turn": pushed / turns,
        "kv_reused_bytes_per_turn": held / turns,
        "kv_pushed_share": pushed / (pushed + held) if pushed + held else None,
        "routing_decisions": decisions,
    }


def ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """kv_aware against each other routing: TTFT p50 (other / kv_aware: how many times lower)
    and hit rates."""
    by = {r["routing"]: r for r in rows if "error" not in r}
    if "kv_aware" not in by:
        return {}
    kv = by["kv_aware"]
    out: dict[str, float | None] = {"hit_rate_kv_aware": kv["prefill_hit_rate"],
                                    "kv_pushed_share_kv_aware": kv["kv_pushed_share"]}
    for name, other in by.items():
        if name != "kv_aware":
            out[f"ttft_p50_{name}_over_kv_aware"] = _div(other["ttft_p50_s"], kv["ttft_p50_s"])
            out[f"hit_rate_{name}"] = other["prefill_hit_rate"]
    return out if len(by) > 1 else {}


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_rows(rows: list[dict[str, Any]], ratio: dict[str, float | None]) -> str:
    head = (f"{'routing':<10}{'done':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'out tok/s':>11}{'hit rate':>10}{'KV pushed/turn':>16}{'pushed share':>14}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['routing']:<10}  {r['error']}")
            continue
        lines.append(
            f"{r['routing']:<10}{r['completed']:>6}{_ms(r['ttft_p50_s']):>10}"
            f"{_ms(r['ttft_p99_s']):>10}{_ms(r['tpot_p50_s']):>10}{r['output_tok_s']:>11.1f}"
            f"{_pct(r['prefill_hit_rate']):>10}{r['kv_pushed_bytes_per_turn'] / 2**20:>12.2f} MiB"
            f"{_pct(r['kv_pushed_share']):>14}")
    lines.append("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()
                                        if v is not None))
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    return bench_main("kv_routing", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
