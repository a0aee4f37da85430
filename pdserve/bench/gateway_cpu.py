"""The HTTP front's CPU per streamed token: the split's gateway against the colocated server's
HTTP process, on the tiny model (a CPU box is enough).

    python -m pdserve.bench.gateway_cpu [--systems colocated,grpc] [--rounds 2]
        [--variant NAME=ENV=VALUE ...] [--output-json FILE]

NOTE: what is measured. Each round runs `pdserve.bench.gpu_serve --shape tiny` once per system
and variant (alternating), all requests at once (--num-prompts x --output-len tokens, greedy),
with the servers' stack samplers gated on the load (PDSERVE_STACK_SAMPLES and
PDSERVE_STACK_SAMPLE_WHILE: engine/stack_sampler.py writes each thread's CPU seconds from /proc).
Reported: the event-loop thread's (MainThread's) CPU microseconds per output token of the HTTP
processes, summed over them: `gateway-*` for a split system, `serve-*` for colocated; the rest
of their threads (gRPC's, the sampler's own) is left out. Beside it, the tokens a streamed chunk
carried (a gateway behind its streams joins a choice's waiting outputs). A variant is the same
run with an environment variable set (every flag of pdserve's services reads PDSERVE_<FLAG>), e.g.
`--variant unrecorded=PDSERVE_RESUME_TTL_SECONDS=0`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report

HTTP_ROLES = {"colocated": "serve"}  # the HTTP processes' role of each system; else "gateway"


def loop_cpu_us_per_token(samples: Path, role: str, output_tokens: int) -> float:
    """The MainThread CPU of every `role` process in a stack-samples folder, per token."""
    files = sorted(samples.glob(f"{role}-*.cpu.json"))
    if not files or output_tokens <= 0:
        raise ValueError(f"no {role} CPU in {samples} or no output tokens ({output_tokens})")
    cpu = 0.0
    for f in files:
        threads = json.loads(f.read_text())["threads_cpu_s"]
        cpu += sum(s for name, s in threads.items() if name.startswith("MainThread"))
    return 1e6 * cpu / output_tokens


def tokens_per_chunk(run: dict[str, Any]) -> float:
    """A load test run's output tokens (the usage) over its chunks that carried text."""
    tokens = sum(r.get("completion_tokens") or 0 for r in run["requests"])
    chunks = sum(len(r.get("chunk_at") or []) for r in run["requests"])
    return tokens / chunks if chunks else 0.0


def one_run(system: str, env: dict[str, str], args: argparse.Namespace, work: Path
            ) -> tuple[float, float]:
    samples, out = work / "samples", work / "out"
    argv = [sys.executable, "-m", "pdserve.bench.gpu_serve", "--shape", "tiny", "--systems",
            system, "--num-prompts", str(args.num_prompts), "--input-len", args.input_len,
            "--output-len", str(args.output_len), "--request-rate", "inf", "--kv-cache-memory",
            str(args.kv_cache_memory), "--client-processes", "1", "--out-dir", str(out)]
    run_env = {**os.environ, **env, "PDSERVE_STACK_SAMPLES": str(samples),
               "PDSERVE_STACK_SAMPLE_WHILE": str(work / "gate")}
    subprocess.run(argv, env=run_env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT)
    run = json.loads((out / f"loadtest_{system}.json").read_text())["runs"][-1]
    us = loop_cpu_us_per_token(samples, HTTP_ROLES.get(system, "gateway"), run["output_tokens"])
    return us, tokens_per_chunk(run)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, sep, assignment = text.partition("=")
    key, sep2, value = assignment.partition("=")
    if not (name and sep and key and sep2):
        raise ValueError(f"--variant takes NAME=ENV=VALUE, got {text!r}")
    return name, {key: value}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default="colocated,grpc")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=ENV=VALUE: the split systems run again with that environment")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="16-64")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory", type=int, default=128 << 20)
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    systems = [s for s in args.systems.split(",") if s]
    variants = [parse_variant(v) for v in args.variant]
    if args.rounds < 1 or not systems:
        raise ValueError("--rounds must be >= 1 and --systems name one at least")
    cases = [(s, "", {}) for s in systems]
    cases += [(s, name, env) for name, env in variants for s in systems if s != "colocated"]
    results: dict[str, list[float]] = {}
    per_chunk: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for system, name, env in cases:
            label = f"{system}+{name}" if name else system
            with tempfile.TemporaryDirectory() as tmp:
                us, tpc = one_run(system, env, args, Path(tmp))
            results.setdefault(label, []).append(round(us, 1))
            per_chunk.setdefault(label, []).append(round(tpc, 3))
            print(f"round {r + 1}  {label:24s} {us:7.1f} CPU us a token, {tpc:.2f} tokens a "
                  "chunk", flush=True)
    medians = {k: statistics.median(v) for k, v in results.items()}
    for k, v in medians.items():
        print(f"median   {k:24s} {v:7.1f} CPU us a token")
    report = {"config": config_of(args), "rounds": results, "tokens_per_chunk": per_chunk,
              "medians": medians}
    if args.output_json:
        write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("gateway_cpu", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
