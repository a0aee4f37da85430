"""Latency of the disaggregated pipeline: the KV handover, and the gateway's cost in TTFT.

    python -m pdserve.bench.pipeline [--prompt-lens 256,1024] [--handover-len 1024] [--repeats 5]
    python -m pdserve.bench.pipeline --url http://127.0.0.1:8000 --redis-url redis://... (a
        running `pdserve up`; by default the benchmark starts its own on the bundled model)

NOTE: two measurements, over a real `pdserve up` cluster (gateway, tokenizer, 1 prefill and
1 decode worker, Redis) driven by the openai client, streamed, one request at a time:

  handover   one `--handover-len` prompt, max_tokens 2 (ignore_eos). Client clock: time to the
             first token (TTFT) and to the second. Redis request hash (gateway clock, the same
             machine): prefill = ts_transferring - ts_prefilling (the Prefill rpc: the forward
             pass and the first token), handover = ts_decoding - ts_transferring (prefill's end
             to the second token off the decode worker: transfer, commit, one decode step).
             Worker counters (Prometheus, addresses from the registry), read before and after:
             kv_transfer_seconds and kv_transfer_bytes of the prefill (sender: push to reply) and
             decode (receiver: header to commit) workers; the push streams while the prompt is
             computed, so both span the prefill too. What overlapped: the prefill worker's
             kv_transfer_bytes_before_first_token, and what did not, its
             kv_transfer_first_token_to_commit_seconds (first token to the commit sent). The
             first token must not wait for the transfer: TTFT ~ queueing + prefill.
  ttft       TTFT through the whole pipeline (gateway -> tokenizer-free token-id prompt ->
             decode reservation -> prefill -> SSE) against the in-process engine
             (`AsyncLLMEngine`, same model and flags, in this process) on the same prompt, per
             `--prompt-lens`; the difference is what the services cost. As CPU prefill time
             swings with the box's load, each pipeline request's TTFT beside its Prefill rpc
             (TTFT - (ts_transferring - ts_prefilling), from Redis) is reported too.

Prompts are seeded random token ids (no special tokens), new each repeat so no prefix cache
helps; every request is greedy with logprobs=0 so each token comes in its own SSE chunk.
Medians over `--repeats` after one warm-up each. CPU timings on a shared box move with other
processes: the report records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.throughput import make_workload
from pdserve.bench.transfer import parse_sizes
from pdserve.ports import free_port

COUNTERS = ("kv_transfer_seconds", "kv_transfer_bytes", "kv_transfers",
            "kv_transfer_bytes_before_first_token", "kv_transfer_first_token_to_commit_seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to `parser` (shared by `pdserve bench pipeline`)."""
    parser.add_argument("--model", default=None, help="local HF folder or .gguf (default: bundled)")
    parser.add_argument("--url", default="", help="gateway of a running cluster (default: start "
                                                  "`pdserve up` for the run)")
    parser.add_argument("--redis-url", default="", help="that cluster's Redis (with --url)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes per engine")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--handover-len", type=int, default=1024, help="prompt tokens, handover")
    parser.add_argument("--prompt-lens", type=parse_sizes, default=[256, 1024], metavar="A,B,..",
                        help="prompt tokens, TTFT comparison")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--output-json", default="bench_results/pipeline.json")


# ---- the cluster --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterInfo:
    url: str
    redis_url: str


@contextlib.contextmanager
def start_cluster(args: argparse.Namespace, workdir: Path) -> Iterator[ClusterInfo]:
    """`pdserve up` (1 prefill + 1 decode) on a free port, until its cluster file says it is up;
    SIGTERM (the whole cluster stops) on exit: SIGINT is ignored by a command a shell started in
    the background. Its output goes to `workdir`/cluster.log."""
    port, cluster_file, log = free_port(), workdir / "cluster.json", workdir / "cluster.log"
    model = ["--model", args.model] if args.model else []
    argv = [sys.executable, "-m", "pdserve.cli", "up", *model, "--port", str(port),
            "--max-model-len", str(args.max_model_len), "--kv-cache-memory",
            str(args.kv_cache_memory), "--dtype", args.dtype, "--log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PDSERVE_CLUSTER_FILE": str(cluster_file)})
    try:
        deadline = time.monotonic() + args.startup_timeout
        while not cluster_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield ClusterInfo(f"http://127.0.0.1:{port}",
                          json.loads(cluster_file.read_text())["redis_url"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)  # it gives each of its services 15 s
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- what the cluster tells: Redis request state, worker counters -------------------------------
async def request_state(redis_url: str, request_id: str) -> dict[str, str]:
    """The request's hash in Redis (status, ts_<status>, ...); {} if it has none."""
    from pdserve.cluster.state import RequestStore, connect

    client = connect(redis_url)
    try:
        return await RequestStore(client).get(request_id) or {}
    finally:
        await client.aclose()


async def metrics_addresses(redis_url: str, timeout_s: float = 15.0) -> dict[str, str]:
    """role -> metrics host:port of the prefill and decode workers in the registry (exactly
    one of each, so that their counters are this benchmark's requests)."""
    from pdserve.cluster.registry import WorkerRegistry
    from pdserve.cluster.state import connect

    client = connect(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            workers = [w for w in await WorkerRegistry(client).list_workers()
                       if w.role in ("prefill", "decode") and w.metrics_address]
            found = {w.role: w.metrics_address for w in workers}
            if len(workers) == 2 and len(found) == 2:
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(f"need one prefill and one decode worker with a metrics "
                                   f"port, the registry has {[w.worker_id for w in workers]}")
            await asyncio.sleep(0.5)
    finally:
        await client.aclose()


def scrape(address: str) -> dict[str, float]:
    """The transfer counters of one worker's /metrics (`pdserve:<name>`, summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("pdserve:")
        if name in values:
            values[name] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return values


def scrape_all(addresses: dict[str, str]) -> dict[str, dict[str, float]]:
    return {role: scrape(address) for role, address in addresses.items()}


def counter_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    return {role: {k: after[role][k] - before[role][k] for k in COUNTERS} for role in before}


# ---- streamed requests --------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamTiming:
    """One streamed request: its id and, on the wall clock, when it left and each token came."""

    request_id: str
    sent_at: float
    token_at: list[float]

    def token_s(self, index: int) -> float:
        """Seconds from sending to token `index` (0: the first)."""
        return self.token_at[index] - self.sent_at


async def stream_once(client: Any, model: str, prompt: list[int], max_tokens: int) -> StreamTiming:
    """A streamed greedy completion of `prompt` (token ids), exactly `max_tokens` tokens."""
    sent = time.time()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        logprobs=0, extra_body={"ignore_eos": True},
    )
    request_id, token_at = "", []
    async for chunk in stream:
        now = time.time()
        request_id = chunk.id
        for choice in chunk.choices:
            tokens = choice.logprobs.tokens if choice.logprobs is not None else None
            token_at += [now] * (len(tokens) if tokens else int(bool(choice.text)))
    if len(token_at) != max_tokens:
        raise RuntimeError(f"{request_id}: {len(token_at)} tokens streamed, {max_tokens} asked")
    return StreamTiming(request_id, sent, token_at)


async def engine_ttft(engine: Any, prompt: list[int], request_id: str, max_tokens: int) -> float:
    """Seconds from `AsyncLLMEngine.generate` to its first token (then run to the end)."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    sent, first = time.perf_counter(), None
    async for out in engine.generate(prompt, params, request_id):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter() - sent
    assert first is not None
    return first


# ---- (a) the handover ---------------------------------------------------------------------------
@dataclass
class Context:
    """What every measurement uses: the cluster, its client and model, the in-process engine."""

    cluster: ClusterInfo
    client: Any
    model: str
    metrics: dict[str, str]
    engine: Any
    tokenizer: Any
    seed: int = 0

    def prompts(self, length: int, count: int) -> list[list[int]]:
        """Fresh seeded random prompts of `length` tokens (never the same twice in a run)."""
        self.seed += 1
        return make_workload(self.tokenizer, count, (length, length), (1, 1), self.seed).prompts


async def handover_once(ctx: Context, prompt: list[int]) -> dict[str, float]:
    """One 2-token request: client timings, its Redis timeline, the workers' counter deltas."""
    before = scrape_all(ctx.metrics)
    t = await stream_once(ctx.client, ctx.model, prompt, 2)
    deltas, state = await _settled(ctx, before, t.request_id)
    ts = {k.removeprefix("ts_"): float(v) for k, v in state.items() if k.startswith("ts_")}
    transfer_s, ttft, second = deltas["decode"]["kv_transfer_seconds"], t.token_s(0), t.token_s(1)
    return {
        "ttft_s": ttft, "second_token_s": second,
        "reserved_at_s": ts["prefilling"] - t.sent_at,  # decode blocks reserved, prefill called
        "prefill_s": ts["transferring"] - ts["prefilling"],
        "handover_s": ts["decoding"] - ts["transferring"],
        "ttft_after_prefill_s": ttft - (ts["transferring"] - t.sent_at),
        "transfer_bytes": deltas["decode"]["kv_transfer_bytes"],
        "transfer_s": transfer_s,
        "sender_transfer_s": deltas["prefill"]["kv_transfer_seconds"],
        "bytes_before_first_token": deltas["prefill"]["kv_transfer_bytes_before_first_token"],
        "first_token_to_commit_s": deltas["prefill"]["kv_transfer_first_token_to_commit_seconds"],
        "transfer_share_of_ttft": transfer_s / ttft,
        "transfer_share_of_second_token": transfer_s / second,
    }


async def _settled(
    ctx: Context, before: dict[str, dict[str, float]], request_id: str, timeout_s: float = 10.0
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Counter deltas and Redis state once both workers counted the transfer and the request's
    state is final (the prefill worker may hear the decode worker's reply after the client)."""
    deadline = time.monotonic() + timeout_s
    while True:
        deltas = counter_deltas(before, scrape_all(ctx.metrics))
        state = await request_state(ctx.cluster.redis_url, request_id)
        done = all(d["kv_transfers"] == 1 for d in deltas.values())
        if done and state.get("status") == "finished":
            return deltas, state
        if time.monotonic() > deadline:
            raise RuntimeError(f"{request_id}: counters {deltas}, state {state}")
        await asyncio.sleep(0.05)


async def bench_handover(ctx: Context, length: int, repeats: int) -> dict[str, Any]:
    runs = []
    for i, prompt in enumerate(ctx.prompts(length, repeats + 1)):
        run = await handover_once(ctx, prompt)
        if i:  # the first is a warm-up
            runs.append(run)
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"prompt_tokens": length, "median": medians, "runs": runs}


# ---- (b) TTFT: the pipeline against the in-process engine ---------------------------------------
async def bench_ttft(ctx: Context, length: int, repeats: int) -> dict[str, Any]:
    """Both systems on the same fresh prompt each round, which goes first alternating; the
    first round is a warm-up."""
    pipeline, local, beside = [], [], []
    for i, prompt in enumerate(ctx.prompts(length, repeats + 1)):
        if i % 2:
            e = await engine_ttft(ctx.engine, prompt, f"local-{length}-{i}", 2)
        t = await stream_once(ctx.client, ctx.model, prompt, 2)
        if not i % 2:
            e = await engine_ttft(ctx.engine, prompt, f"local-{length}-{i}", 2)
        state = await request_state(ctx.cluster.redis_url, t.request_id)
        prefill_s = float(state["ts_transferring"]) - float(state["ts_prefilling"])
        if i:
            pipeline.append(t.token_s(0))
            local.append(e)
            beside.append(t.token_s(0) - prefill_s)
    return {
        "prompt_tokens": length, "pipeline_s": pipeline, "in_process_s": local,
        "pipeline_median_s": statistics.median(pipeline),
        "in_process_median_s": statistics.median(local),
        "overhead_median_s": statistics.median(p - e for p, e in zip(pipeline, local)),
        "beside_prefill_median_s": statistics.median(beside),
    }


# ---- driver -------------------------------------------------------------------------------------
async def measure(args: argparse.Namespace, cluster: ClusterInfo) -> dict[str, Any]:
    """Both measurements against `cluster`, the in-process engine loaded here."""
    try:
        import openai
    except ImportError as exc:
        raise SystemExit("the pipeline benchmark needs the openai client: "
                         "pip install 'pdserve[test]'") from exc
    from engine.async_engine import AsyncLLMEngine

    engine = await asyncio.to_thread(
        AsyncLLMEngine.from_args, args.model, dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    try:
        model = (await client.models.list()).data[0].id
        ctx = Context(cluster, client, model, await metrics_addresses(cluster.redis_url),
                      engine, engine.engine.tokenizer, seed=args.seed * 1000)
        handover = await bench_handover(ctx, args.handover_len, args.repeats)
        ttft = [await bench_ttft(ctx, n, args.repeats) for n in args.prompt_lens]
    finally:
        await client.close()
        engine.shutdown()
    return {"handover": handover, "ttft": ttft}


def format_table(report: dict[str, Any]) -> str:
    """The report as readable text tables (milliseconds)."""
    h, load = report["handover"]["median"], report["environment"]["load_avg_1m_at_start"]
    lines = [
        f"handover, {report['handover']['prompt_tokens']}-token prompt, medians of "
        f"{report['config']['repeats']} | load average {load:.1f}",
        f"  KV moved {h['transfer_bytes'] / (1 << 20):.1f} MiB in {1e3 * h['transfer_s']:.1f} ms"
        f" (decode, header to commit; prefill sender {1e3 * h['sender_transfer_s']:.1f} ms), "
        f"{h['bytes_before_first_token'] / (1 << 20):.1f} MiB before the first token, commit "
        f"{1e3 * h['first_token_to_commit_s']:.1f} ms after it",
        f"  TTFT {1e3 * h['ttft_s']:.1f} ms = reserve {1e3 * h['reserved_at_s']:.1f} + prefill "
        f"{1e3 * h['prefill_s']:.1f} + {1e3 * h['ttft_after_prefill_s']:.1f}; second token "
        f"{1e3 * h['second_token_s']:.1f} ms (prefill end -> 2nd token "
        f"{1e3 * h['handover_s']:.1f})",
        f"  transfer / TTFT {100 * h['transfer_share_of_ttft']:.0f}%, transfer / 2nd token "
        f"{100 * h['transfer_share_of_second_token']:.0f}%",
        f"{'prompt':>8}{'pipeline TTFT ms':>18}{'in-process ms':>15}{'difference ms':>15}"
        f"{'TTFT - prefill rpc ms':>23}",
    ]
    for t in report["ttft"]:
        lines.append(f"{t['prompt_tokens']:>8}{1e3 * t['pipeline_median_s']:>18.1f}"
                     f"{1e3 * t['in_process_median_s']:>15.1f}"
                     f"{1e3 * t['overhead_median_s']:>15.1f}"
                     f"{1e3 * t['beside_prefill_median_s']:>23.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark for parsed `args`, print the tables, write the JSON report; return it."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if bool(args.url) != bool(args.redis_url):
        raise ValueError("--url and --redis-url go together (a running cluster)")
    started, load = time.perf_counter(), os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        cluster = ClusterInfo(args.url, args.redis_url)
        if not args.url:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-")))
            cluster = stack.enter_context(start_cluster(args, workdir))
        results = asyncio.run(measure(args, cluster))
    report = {"config": config_of(args),
              "environment": {"cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
              "cluster_started": not args.url, **results,
              "elapsed_s": time.perf_counter() - started}
    print(format_table(report))
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("pipeline", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
