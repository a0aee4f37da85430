"""The cost of a speculative verification step against a plain decode step (GPU).

    python -m pdserve.bench.spec_decode_steps [--batches 1,32] [--ks 1,2,3,4,5] [--steps 48]
                                              [--no-eager]

A random-weight Llama-3.2-1B shape in bf16 (pdserve/bench/gpu_model.py). Every request always
has k drafts (the proposer is replaced by one that repeats the last token, and the per-request
policy that turns drafts down is held at k), so every decode step verifies k drafts; with k = 0
no speculation is configured (plain decode; "0s": with steps not overlapped, as speculative
steps never are). Reported per batch size and k: the median step time in ms replayed from CUDA
graphs (verification steps one row per token, engine/spec_graphs.py) and run eagerly
(`enforce_eager`; skipped with --no-eager), each with "(fwd)", the median GPU time of the step's
forward alone (CUDA events around it: eagerly, launch gaps included), and the graph step's ratio
to the plain graph step; "replayed" counts the steps served by a graph. At an acceptance length
L (tokens per step), speculation gains when L / ratio > 1.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.gpu_model import ModelShape, save_random_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,32")
    p.add_argument("--ks", default="1,2,3,4,5")
    p.add_argument("--steps", type=int, default=48, help="decode steps per measurement")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--no-eager", action="store_true", help="graph-replayed steps only")


@dataclass
class StepTime:
    ms: float  # median step time
    forward_ms: float  # median GPU time of the step's target forward (CUDA events around it)
    replayed: int  # decode steps served by a CUDA graph
    steps: int  # decode steps timed


def step_ms(
    folder: str, k: int, batch: int, args: argparse.Namespace, eager: bool = False,
    overlap: bool = True,
) -> StepTime:
    spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
    llm = LLM(
        folder,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=64,
        kv_cache_memory=8 << 30,
        speculative_config=spec,
        enforce_eager=eager,
        async_scheduling=overlap,
    )
    engine = llm.llm_engine
    if engine.proposer is not None:
        engine.proposer.propose = lambda req: [req.output_token_ids[-1]] * k
    if engine.planner is not None:  # every step verifies k drafts per request
        engine.planner.plan = lambda acceptance, proposed, base, cost: list(proposed)
    times: list[float] = []
    step = engine.step

    def timed() -> list:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return outs

    engine.step = timed
    forward = engine.runner._forward
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed_forward(*a):  # GPU time from the forward's first launch to its last one's end
        marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks[0].record()
        out = forward(*a)
        marks[1].record()
        events.append(marks)
        return out

    engine.runner._forward = timed_forward
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(args.prompt_len)]}
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times.clear()
    events.clear()
    graphs = engine.runner.graphs
    before = graphs.replays if graphs is not None else 0
    llm.generate(prompts, params, use_tqdm=False)
    replayed = (graphs.replays - before) if graphs is not None else 0
    torch.cuda.synchronize()
    forward_ms = statistics.median(a.elapsed_time(b) for a, b in events[2:])
    events.clear()
    del llm, engine, graphs
    gc.collect()  # the engine's cycles (engine.step = timed): its KV cache goes back now
    torch.cuda.empty_cache()
    # decode steps only (the first two steps: the prefill, then the first decode)
    return StepTime(1e3 * statistics.median(times[2:]), forward_ms, replayed, len(times) - 1)


def _cells(t: StepTime) -> str:
    return f"{t.ms:>9.2f} {t.forward_ms:>6.2f}"


def run(args: argparse.Namespace) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(ModelShape(), Path(tmp), 0, torch.device("cuda"))
        print(f"{'batch':>5} {'k':>2} {'graph ms':>9} {'(fwd)':>6} {'eager ms':>9} {'(fwd)':>6}"
              f" {'ratio':>6}  replayed")
        for batch in (int(b) for b in args.batches.split(",")):
            plain = 0.0
            for k in [0] + [int(x) for x in args.ks.split(",")]:
                graph = step_ms(tmp, k, batch, args)
                plain = plain or graph.ms
                eager = "" if args.no_eager else _cells(step_ms(tmp, k, batch, args, True))
                print(f"{batch:>5} {k:>2} {_cells(graph)} {eager:>16} {graph.ms / plain:>6.2f}"
                      f"  {graph.replayed}/{graph.steps}", flush=True)
                if k == 0:
                    serial = step_ms(tmp, 0, batch, args, overlap=False)
                    print(f"{batch:>5} {'0s':>2} {_cells(serial)} {'':>16} "
                          f"{serial.ms / plain:>6.2f}  {serial.replayed}/{serial.steps}"
                          f"  (plain, steps not overlapped)", flush=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    logging.basicConfig(format="    %(message)s")  # each engine's graph capture: time, memory
    logging.getLogger("engine.cuda_graphs").setLevel(logging.INFO)
    raise SystemExit(0 if run(parser.parse_args()) else 1)


if __name__ == "__main__":
    main()
