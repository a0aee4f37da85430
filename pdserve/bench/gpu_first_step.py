"""A decode engine's host time per step for a request just committed, after the engine sat idle
and without idling, split by phase: what a KV handover pays on an idle decode worker.

    python -m pdserve.bench.gpu_first_step [--requests 10] [--idle-ms 50] [--out DIR]
        [--host-argmax]

In one process, the 1B-shaped random model in bf16, decode role: each request's 1024-token
prompt is reserved and committed (its KV is whatever the blocks hold: only time is measured),
then stepped to 8 tokens. The first half of the requests are committed after `--idle-ms` with
the engine idle, the others at once. Each step's wall time, and inside it the host time of the
scheduler, the input packing, the step's tensors to the device, the forward (a CUDA graph
replay), the logits, the sampling and the landing of the previous step's tokens; greedy steps
replay an argmax graph instead of the last three (`argmax_replay`) unless `--host-argmax`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine.model_runner as model_runner
from engine.cuda_graphs import DecodeGraphs
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from pdserve import SamplingParams
from pdserve.bench.gpu_model import ModelShape, save_stand_in_tokenizer
from pdserve.bench.gpu_serve import build_model

PROMPT_TOKENS = 1024
STEPS = 8


def _timed(acc: dict[str, float], name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - start
    return wrapper


def _instrument(engine: LLMEngine, acc: dict[str, float]) -> None:
    """Time the step's phases (module functions and this engine's bound methods)."""
    for name in ("pack_step", "step_tensors", "forward_step"):
        setattr(model_runner, name, _timed(acc, name, getattr(model_runner, name)))
    runner = engine.runner
    runner._sample = _timed(acc, "sample", runner._sample)  # type: ignore[method-assign]
    runner.model.compute_logits = _timed(acc, "logits", runner.model.compute_logits)
    if runner.graphs is not None:  # a greedy step's forward, logits and argmax: one replay
        runner.graphs.run_argmax = _timed(acc, "argmax_replay", runner.graphs.run_argmax)
    engine.scheduler.schedule = _timed(acc, "schedule", engine.scheduler.schedule)
    engine._land = _timed(acc, "land", engine._land)  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model_dir)
    if args.host_argmax:  # the greedy steps' logits and argmax launched from the host
        DecodeGraphs.argmax_max_batch = 0
    shape = ModelShape(max_positions=PROMPT_TOKENS + 64)
    build_model(shape, str(model), 0)
    save_stand_in_tokenizer(shape.vocab, model)
    engine = LLMEngine(build_engine_config(
        str(model), dtype="bfloat16", role="decode", device="cuda", num_kv_blocks=1024,
        max_model_len=PROMPT_TOKENS + 16, max_num_seqs=4))
    acc: dict[str, float] = collections.defaultdict(float)
    _instrument(engine, acc)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    rows = []
    for r in range(args.requests + 1):  # the first: warm-up, not reported
        rid = f"r{r}"
        engine.reserve_request(rid, [100 + i % 1000 for i in range(PROMPT_TOKENS)], params)
        torch.cuda.synchronize()
        idle = r <= args.requests // 2
        if idle:
            time.sleep(args.idle_ms / 1e3)
        engine.commit_request(rid, 5, None)
        steps = []
        while engine.has_work():
            acc.clear()
            start = time.perf_counter()
            engine.step()
            steps.append({"ms": 1e3 * (time.perf_counter() - start),
                          **{k: 1e3 * v for k, v in acc.items()}})
        if r:
            rows.append({"idle": idle, "steps": steps})
    engine.runner.shutdown()

    def median(idle: bool, step: int) -> dict[str, float]:
        picked = [row["steps"][step] for row in rows if row["idle"] == idle]
        return {k: statistics.median(s.get(k, 0.0) for s in picked) for k in picked[0]}

    summary = {f"{'idle' if idle else 'hot'}_step{step}": median(idle, step)
               for idle in (True, False) for step in (0, 1, 3)}
    return {"config": vars(args), "gpu": torch.cuda.get_device_name(), "summary": summary,
            "requests": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--idle-ms", type=float, default=50.0)
    parser.add_argument("--model-dir", default="/tmp/model-1b-first-step")
    parser.add_argument("--host-argmax", action="store_true",
                        help="no argmax graphs (engine/cuda_graphs.py): logits and argmax "
                             "launched from the host")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    report = run(args)
    for name, phases in report["summary"].items():
        print(f"{name:>11}: " + " ".join(f"{k}={v:.2f}" for k, v in phases.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_first_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
