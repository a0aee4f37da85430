"""The host cost of many concurrent streams through `AsyncLLMEngine` (what every server runs).

    python -m pdserve.bench.async_streams [--streams 256] [--tokens 64] [--rounds 3]

NOTE: a server's engine thread hands each step's outputs to the event loop that reads them.
With a model so small that the forward costs little (one layer of hidden 32, one CPU thread),
`--streams` requests of `--tokens` greedy tokens each, all at once, read by one task each as
`output_kind="delta"` outputs: what is left per token is the engine's bookkeeping and that
hand-over. Reported per round (the first warms up and is left out): output tokens/s and this
process's CPU ms per 1000 output tokens (both threads).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.async_engine import AsyncLLMEngine
from engine.sampling_params import SamplingParams
from pdserve.bench.gpu_model import ModelShape, save_random_model
from pdserve.bench.report import bench_main, config_of, write_report

SHAPE = ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                   vocab=512, max_positions=512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=256, help="requests at once")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens each")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (the first warms up)")
    parser.add_argument("--output-json", default="bench_results/async_streams.json")


async def _rounds(model: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    engine = AsyncLLMEngine.from_args(str(model), device="cpu", dtype="float32",
                                      max_num_seqs=args.streams, kv_cache_memory=64 << 20,
                                      max_model_len=256)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                            output_kind="delta")

    async def one(request_id: str) -> int:
        prompt = [rng.randrange(5, SHAPE.vocab) for _ in range(8)]
        return sum([len(out.outputs[0].token_ids)
                    async for out in engine.generate(prompt, params, request_id)])

    rows = []
    try:
        for r in range(args.rounds):
            wall, cpu = time.perf_counter(), time.process_time()
            tokens = sum(await asyncio.gather(*(one(f"r{r}-{i}")
                                                for i in range(args.streams))))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            assert tokens == args.streams * args.tokens, tokens
            rows.append({"tok_s": tokens / wall, "cpu_ms_per_1k_tokens": 1e6 * cpu / tokens})
            print(f"round {r}: {tokens / wall:.0f} tok/s, {1e6 * cpu / tokens:.1f} CPU ms per "
                  "1000 tokens", flush=True)
    finally:
        engine.shutdown()
    return rows[1:]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.streams < 1 or args.tokens < 1 or args.rounds < 2:
        raise ValueError("--streams and --tokens >= 1, --rounds >= 2 (the first warms up)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_random_model(SHAPE, model, 0, torch.device("cpu"))
        rows = asyncio.run(_rounds(model, args))
    report = {"config": config_of(args), "rounds": rows,
              "median_tok_s": statistics.median(r["tok_s"] for r in rows),
              "median_cpu_ms_per_1k_tokens": statistics.median(
                  r["cpu_ms_per_1k_tokens"] for r in rows)}
    print(f"median: {report['median_tok_s']:.0f} tok/s, "
          f"{report['median_cpu_ms_per_1k_tokens']:.1f} CPU ms per 1000 tokens")
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("async_streams", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
