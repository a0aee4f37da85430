"""CPU decode on a GGUF model: kept quantized (engine/quant/) against de-quantized fp32, one run.

    python -m pdserve.bench.cpu_gguf [--model X.gguf] [--threads 2] [--rounds 2]

NOTE: each (variant, round) runs in a fresh subprocess, the variants interleaved round by round,
so that resident memory is that of one engine and a noisy neighbour hurts both alike. A
subprocess builds `LLM(model, kv_cache_memory=256 MiB, max_model_len=1024)` and measures:

  load_s         seconds to build the engine (config, tokenizer, weights, KV cache)
  rss_mib        resident memory right after the engine is built (imports, weights, KV cache)
  weights_mib    bytes the model's modules hold (quantized kernels' packed data, or fp params)
  ms_per_token   single stream, greedy: (time of 1 + N tokens - time of 1 token) / N
  batch_tok_s    `--batch` requests of `--prompt-len` random ids, `--batch-tokens` each, at once:
                 output tokens / wall time (prefill included)

Variants: `gguf` (quantization "gguf", dtype auto = bf16 activations) and `fp32` (quantization
"none", dtype float32: today's de-quantized path). The report holds each round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report

VARIANTS = {"gguf": {"quantization": "gguf"}, "fp32": {"quantization": "none", "dtype": "float32"}}
METRICS = ("load_s", "rss_mib", "weights_mib", "ms_per_token", "batch_tok_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled one)")
    parser.add_argument("--variants", default="gguf,fp32", help="comma-separated: gguf, fp32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-json", default="bench_results/cpu_gguf.json")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # a subprocess's variant


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return {}
    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants.split(",")}
    for r in range(args.rounds):
        for variant in rounds:
            result = _subprocess(args, variant)
            rounds[variant].append(result)
            print(f"round {r} {variant}: " + ", ".join(f"{k} {result[k]:.1f}" for k in METRICS))
    medians = {
        v: {k: statistics.median(x[k] for x in rs) for k in METRICS} for v, rs in rounds.items()
    }
    for v, m in medians.items():
        print(f"median {v}: " + ", ".join(f"{k} {m[k]:.1f}" for k in METRICS))
    report = {"config": config_of(args), "rounds": rounds, "medians": medians}
    write_report(report, args.output_json)
    return report


def _subprocess(args: argparse.Namespace, variant: str) -> dict[str, float]:
    argv = [sys.executable, "-m", "pdserve.bench.cpu_gguf", "--one", variant]
    for flag in ("model", "threads", "single_tokens", "batch", "batch_tokens", "prompt_len"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    out = subprocess.run(
        argv,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, variant: str) -> dict[str, float]:
    """One engine of `variant`: its memory after load, single-stream and batched speed."""
    import torch

    from pdserve import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(
        args.model, kv_cache_memory=256 << 20, max_model_len=1024, device="cpu", **VARIANTS[variant]
    )
    load_s = time.perf_counter() - start
    rss = _rss_mib()
    weights = _weights_bytes(llm.llm_engine.runner.model) / 2**20
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]

    def timed(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed([prompt], 8)  # warm-up
    n = args.single_tokens
    single = min(timed([prompt], 1 + n) - timed([prompt], 1) for _ in range(2)) / n
    batch = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    batched = args.batch * args.batch_tokens / timed(batch, args.batch_tokens)
    return {
        "load_s": load_s,
        "rss_mib": rss,
        "weights_mib": weights,
        "ms_per_token": single * 1e3,
        "batch_tok_s": batched,
    }


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _weights_bytes(model: Any) -> int:
    """Bytes held by the model's weights: quantized modules report theirs, the rest are
    parameters (the quantized modules' empty placeholders count nothing)."""
    held = 0
    for module in model.modules():
        if hasattr(module, "weight_bytes"):
            held += module.weight_bytes()
        held += sum(p.nbytes for p in module.parameters(recurse=False))
    return held


def main(argv: list[str] | None = None) -> int:
    return bench_main("cpu_gguf", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
