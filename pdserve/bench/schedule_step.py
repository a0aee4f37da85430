"""The scheduler's share of a decode step (engine/scheduler.py) and its outputs', alone: no
model, no torch.

    python -m pdserve.bench.schedule_step [--requests 256] [--steps 200] [--rounds 5]

`--requests` plain requests (prompts of 16-48 random ids, greedy, no stop before `--steps`
tokens) admitted and prefilled in a first step, then `--steps` decode steps of all of them at
once: `Scheduler.schedule()`, then `update_from_output()` with a random token for each, then
each request's streamed output as the engine makes it (`mark_progress`, the sequence's
`absorb`, `RequestGroup.make_wire` in delta mode, no detokenizer: a worker's requests, in the
shape its engine core process sends them). Per round, the median microseconds a running
request costs each of the three; reported, each round and the medians of the rounds. An A/B
of two commits runs this module from each checkout in turn, alternating (`python -m` puts the
working directory first on the path).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.output_processor import RequestGroup, SequenceState, mark_progress
from engine.request import Request
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import Scheduler
from pdserve.bench.report import bench_main, config_of, write_report

BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/schedule_step.json")


def _round(args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    n, steps = args.requests, args.steps
    blocks = n * (-(-(48 + steps + 1) // BLOCK_SIZE) + 1)
    scheduler = Scheduler(SchedulerConfig(max_model_len=4096, max_num_seqs=n,
                                          max_num_batched_tokens=max(2048, 48 * n)),
                          BlockManager(blocks, BLOCK_SIZE, True))
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, detokenize=False)
    groups = {}
    for i in range(n):
        prompt = [rng.randrange(5, 50_000) for _ in range(rng.randint(16, 48))]
        req = Request(f"r{i}", prompt, params, max_tokens=steps + 1)
        scheduler.add_request(req)
        groups[req.request_id] = RequestGroup(req.request_id, None, prompt, params.output_kind,
                                              [SequenceState(req, None, None)])
    schedule_s, update_s, outputs_s = [], [], []
    for _ in range(steps + 1):  # the first step prefills every prompt
        start = time.perf_counter()
        out = scheduler.schedule()
        scheduled = time.perf_counter()
        samples = {s.request.request_id: (rng.randrange(5, 50_000), None) for s in out.scheduled}
        sampled = time.perf_counter()
        scheduler.update_from_output(out, samples)
        updated = time.perf_counter()
        now = time.monotonic()
        for s in out.scheduled:
            mark_progress(s.request, now)
            group = groups[s.request.request_id]
            group.seqs[0].absorb()
            group.make_wire()
        schedule_s.append(scheduled - start)
        update_s.append(updated - sampled)
        outputs_s.append(time.perf_counter() - updated)
    return {"schedule_us_per_request": statistics.median(schedule_s[1:]) * 1e6 / n,
            "update_us_per_request": statistics.median(update_s[1:]) * 1e6 / n,
            "outputs_us_per_request": statistics.median(outputs_s[1:]) * 1e6 / n}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.requests, args.steps, args.rounds) < 1:
        raise ValueError("--requests, --steps and --rounds must be positive")
    rng = random.Random(args.seed)
    rounds = []
    for r in range(args.rounds):
        rounds.append(_round(args, rng))
        print(f"round {r}: {_line(rounds[-1])}")
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"median: {_line(medians)}")
    report = {"config": config_of(args), "rounds": rounds, "medians": medians}
    write_report(report, args.output_json)
    return report


def _line(figures: dict[str, float]) -> str:
    return (f"schedule {figures['schedule_us_per_request']:.3f} us, update "
            f"{figures['update_us_per_request']:.3f} us, outputs "
            f"{figures['outputs_us_per_request']:.3f} us a running request")


def main(argv: list[str] | None = None) -> int:
    return bench_main("schedule_step", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
