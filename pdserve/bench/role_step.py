"""A decode step's engine-thread CPU in the two roles a step runs in, on this machine's CPU:
requests added as a colocated engine gets them against requests reserved and committed as a
decode worker gets them (`reserve_request` + `commit_request`, the prompt's KV taken as
written), the same tiny random Llama, the same rows.

    python -m pdserve.bench.role_step [--requests 64] [--steps 60] [--rounds 2]

Per round and role: a fresh engine, `--requests` prompts of 40 tokens, 5 untimed steps, then
the median `time.thread_time()` of `--steps` steps (the step's own work: the scheduler, the
batch's inputs, the forward, the outputs). The roles alternate within each round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.llm import LLM
from engine.sampling_params import RequestOutputKind, SamplingParams
from pdserve.bench.gpu_model import SMALL_MODEL, save_random_model
from pdserve.bench.report import bench_main, config_of, write_report

ROLES = ("colocated", "decode")
PROMPT_LEN = 40
WARM_STEPS = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-json", default="bench_results/role_step.json")


def step_cpu_ms(model_dir: Path, role: str, requests: int, steps: int) -> float:
    """Median thread CPU ms of a decode step of `requests` rows admitted the `role`'s way."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory=64 << 20, max_num_seqs=max(requests, 1), seed=0)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=WARM_STEPS + steps + 2, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, detokenize=False)
    for i in range(requests):
        prompt = [1 + (i * 7 + j) % 500 for j in range(PROMPT_LEN)]
        if role == "decode":
            engine.reserve_request(f"r{i}", prompt, params)
            engine.commit_request(f"r{i}", 5, None)  # the KV as if written, its first token
        else:
            engine.add_request(f"r{i}", prompt, params)
    for _ in range(WARM_STEPS):
        engine.step()
    cpu = []
    for _ in range(steps):
        start = time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - start)
    return statistics.median(cpu) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.requests, args.steps, args.rounds) < 1:
        raise ValueError("--requests, --steps and --rounds must be positive")
    model_dir = Path(tempfile.mkdtemp(prefix="pdserve-role-step-")) / "model"
    save_random_model(SMALL_MODEL.shape, model_dir, 0, torch.device("cpu"))
    rounds = []
    for r in range(args.rounds):
        rounds.append({role: step_cpu_ms(model_dir, role, args.requests, args.steps)
                       for role in ROLES})
        print(f"round {r}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rounds[-1].items())
              + " CPU a step")
    report = {"config": config_of(args), "rounds": rounds,
              "medians": {role: statistics.median(r[role] for r in rounds) for role in ROLES}}
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("role_step", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
