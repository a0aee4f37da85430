"""The host's packing of one step's inputs (engine/input_batch.py `pack_step`), alone.

    python -m pdserve.bench.pack_step [--repeats 30] [--block-size 16]

Three steps built from plain `Request`s with random prompts and shuffled block ids, no model:
nine 1024-token prompt chunks (a long prefill step), one 8192-token chunk, and 256 decodes
at a 400-token context. Each is packed `--repeats` times (block tables kept as arrays across
packs, as the model runner keeps them); the report keeps the best and the median ms of each.
An A/B of two commits runs this module from each checkout in turn, alternating (`python -m`
puts the working directory first on the path).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from engine.input_batch import HostBlockTables, pack_step
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.bench.report import bench_main, config_of, write_report

POOL_BLOCKS = 100_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/pack_step.json")


def _request(rng: random.Random, rid: str, prompt_len: int, block_size: int) -> Request:
    req = Request(rid, [rng.randrange(50_000) for _ in range(prompt_len)],
                  SamplingParams(max_tokens=8))
    req.block_ids = rng.sample(range(POOL_BLOCKS), -(-(prompt_len + 1) // block_size))
    return req


def _prefills(rng: random.Random, count: int, length: int, block_size: int) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(_request(rng, f"p{i}", length, block_size), length)
                            for i in range(count)])


def _decodes(rng: random.Random, count: int, context: int, block_size: int) -> SchedulerOutput:
    out = SchedulerOutput()
    for i in range(count):
        req = _request(rng, f"d{i}", context, block_size)
        req.output_token_ids, req.num_computed_tokens = [5], context
        out.scheduled.append(ScheduledRequest(req, 1))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.repeats < 1 or args.block_size < 1:
        raise ValueError("--repeats and --block-size must be positive")
    rng, size = random.Random(args.seed), args.block_size
    steps = {"prefill 9 x 1024": _prefills(rng, 9, 1024, size),
             "prefill 1 x 8192": _prefills(rng, 1, 8192, size),
             "decode 256 x 400": _decodes(rng, 256, 400, size)}
    tables, results = HostBlockTables(), {}
    for name, out in steps.items():
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            pack_step(out, size, tables=tables)
            times.append(time.perf_counter() - start)
        results[name] = {"best_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}
        print(f"{name}: best {results[name]['best_ms']:.3f} ms, "
              f"median {results[name]['median_ms']:.3f} ms")
    report = {"config": config_of(args), "steps": results}
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("pack_step", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
