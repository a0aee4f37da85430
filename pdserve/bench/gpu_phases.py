"""Where an engine step's time goes on the GPU: host phases against the CUDA-graph replay.

    PYTHONPATH=. python -m pdserve.bench.gpu_phases

Wraps the scheduler, input building, graph replay, eager forward, logits and sampler of one
`LLM` (the 1B-shaped random model of `pdserve bench gpu`) with timers; the device phases
synchronise so their time is the GPU's. Runs 256 requests x 128 tokens, then one request x 256
tokens, and prints the totals and the per-decode-step split. A diagnostic, not a benchmark: the
synchronisations it adds cost a little time of their own.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import engine.model_runner as model_runner
from pdserve import LLM, SamplingParams
from pdserve.bench.gpu_model import ModelShape, save_random_model


def _timed(totals: dict[str, float], key: str, fn: Callable, sync: bool) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
        return result
    return wrapper


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="pdserve-phases-"))
    save_random_model(ModelShape(), folder, seed=0, device=torch.device("cuda"))
    # Steps run one after another here: the timers synchronise, which overlapping would hide.
    llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=16384,
              async_scheduling=False)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    totals: dict[str, float] = {}
    for obj, name, key, sync in (
        (engine.scheduler, "schedule", "schedule", False),
        (engine.scheduler, "update_from_output", "update", False),
        (runner.graphs, "run", "graph_replay", True),
        (runner.model, "forward", "eager_forward", True),
        (runner.model, "compute_logits", "logits", True),
        (runner.sampler, "sample", "sampler", False),
    ):
        setattr(obj, name, _timed(totals, key, getattr(obj, name), sync))
    for name in ("pack_step", "step_tensors"):  # the step's inputs: host lists, then device
        setattr(model_runner, name, _timed(totals, "build_input", getattr(model_runner, name),
                                           False))
    gen = torch.Generator().manual_seed(0)
    for batch, out_len in ((256, 128), (1, 256)):
        prompts = [{"prompt_token_ids": torch.randint(
            0, 128000, (int(torch.randint(128, 512, (1,), generator=gen)),), generator=gen,
        ).tolist()} for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: same shapes
        totals.clear()
        steps_before = runner.graphs.replays
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = max(runner.graphs.replays - steps_before, 1)
        phases = ", ".join(f"{k} {v:.3f}" for k, v in totals.items())
        print(f"batch {batch}: wall {wall:.3f} s, {steps} graph steps; phases (s): {phases}")
        print(f"   per graph step: replay {totals.get('graph_replay', 0) / steps * 1e3:.3f} ms, "
              f"host outside the timed phases {(wall - sum(totals.values())) / steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
