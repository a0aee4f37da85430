"""A single stream's time per token through `AsyncLLMEngine` against the offline `LLM`, by where
the engine was built (engine/omp_threads.py says why that matters on the CPU).

    python -m pdserve.bench.engine_thread [--model X.gguf] [--tokens 128] [--rounds 3]

Each variant runs in a process of its own (which threads have started OpenMP teams is what is
measured, and a process keeps them), on the bundled model by default, greedy, the same prompt:

    offline          LLM.generate on the main thread: the peer
    engine_thread    AsyncLLMEngine.from_args: the engine built on the thread that steps it
    caller_thread    AsyncLLMEngine(LLMEngine(...)): built on the caller's thread, stepped on
                     the engine's (how every server built it before 2026-12-05)

Reported: ms per output token (the median gap between streamed tokens; the offline engine's
wall time per token), the best of `--rounds`, and each variant over the offline one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report

VARIANTS = ("offline", "engine_thread", "caller_thread")
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the bundled GGUF")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--output-json", default="bench_results/engine_thread.json")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"device": args.device, "kv_cache_memory": 64 << 20, "max_model_len": 1024}


def _offline(args: argparse.Namespace) -> list[float]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=4), use_tqdm=False)
    rounds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        rounds.append((time.perf_counter() - start) / args.tokens * 1e3)
    return rounds


async def _streamed(args: argparse.Namespace, variant: str) -> list[float]:
    from engine.async_engine import AsyncLLMEngine
    from engine.llm import build_engine_config
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    if variant == "engine_thread":
        engine = AsyncLLMEngine.from_args(args.model, **_engine_kwargs(args))
    else:
        engine = AsyncLLMEngine(LLMEngine(build_engine_config(args.model,
                                                              **_engine_kwargs(args))))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rounds = []
    try:
        for r in range(args.rounds + 1):  # the first warms up
            stamps = [time.perf_counter() async for _ in engine.generate(PROMPT, params, f"r{r}")]
            if r:
                rounds.append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])) * 1e3)
    finally:
        engine.shutdown()
    return rounds


def _one(args: argparse.Namespace) -> None:
    rounds = (_offline(args) if args.one == "offline"
              else asyncio.run(_streamed(args, args.one)))
    print(json.dumps({"ms_per_token": rounds}))


def run(args: argparse.Namespace) -> None:
    if args.one:
        return _one(args)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        raise ValueError(f"--variants: a list of {', '.join(VARIANTS)}")
    results = {}
    for variant in variants:
        argv = [sys.executable, "-m", "pdserve.bench.engine_thread", "--one", variant,
                "--device", args.device, "--tokens", str(args.tokens),
                "--rounds", str(args.rounds)]
        if args.model:
            argv += ["--model", args.model]
        out = subprocess.run(argv, check=True, capture_output=True, text=True)
        rounds = json.loads(out.stdout.strip().splitlines()[-1])["ms_per_token"]
        results[variant] = {"rounds": rounds, "best": min(rounds)}
        print(f"{variant:14s} ms/token " + " ".join(f"{x:.2f}" for x in rounds)
              + f"  best {min(rounds):.2f}")
    if "offline" in results:
        base = results["offline"]["best"]
        for variant, r in results.items():
            r["over_offline"] = r["best"] / base
            print(f"{variant:14s} {r['best'] / base:.2f}x the offline engine's time a token")
    write_report({"config": config_of(args), "results": results}, args.output_json)


def main(argv: list[str] | None = None) -> int:
    return bench_main("engine_thread", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
