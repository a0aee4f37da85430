"""The cost of a speculative verification step against a plain decode step (GPU).

    python -m pdserve.bench.spec_decode_steps [--batches 1,32] [--ks 1,2,3,4,5] [--steps 48]

A random-weight Llama-3.2-1B shape in bf16 (pdserve/bench/gpu_model.py). Every request always
has k drafts (the proposer is replaced by one that repeats the last token), so every decode step
verifies k drafts; with k = 0 no speculation is configured (plain decode, from a CUDA graph;
"0e": the same step run eagerly, as verification steps are for now). Reported per batch size
and k: the median step time in ms and its ratio to the plain step. At
an acceptance length L (tokens per step), speculation gains when L / ratio > 1.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.gpu_model import ModelShape, save_random_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,32")
    p.add_argument("--ks", default="1,2,3,4,5")
    p.add_argument("--steps", type=int, default=48, help="decode steps per measurement")
    p.add_argument("--prompt-len", type=int, default=512)


def step_ms(
    folder: str, k: int, batch: int, args: argparse.Namespace, eager: bool = False
) -> float:
    spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
    llm = LLM(
        folder,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=64,
        kv_cache_memory=8 << 30,
        speculative_config=spec,
        enforce_eager=eager,
    )
    engine = llm.llm_engine
    if engine.proposer is not None:
        engine.proposer.propose = lambda req: [req.output_token_ids[-1]] * k
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
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(args.prompt_len)]}
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times.clear()
    llm.generate(prompts, params, use_tqdm=False)
    del llm, engine
    torch.cuda.empty_cache()
    return 1e3 * statistics.median(times[2:])  # decode steps only


def run(args: argparse.Namespace) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(ModelShape(), Path(tmp), 0, torch.device("cuda"))
        print(f"{'batch':>5} {'k':>2} {'step ms':>8} {'ratio':>6}")
        for batch in (int(b) for b in args.batches.split(",")):
            plain = step_ms(tmp, 0, batch, args)
            print(f"{batch:>5} {0:>2} {plain:>8.2f} {1.0:>6.2f}", flush=True)
            eager = step_ms(tmp, 0, batch, args, eager=True)
            print(f"{batch:>5} {'0e':>2} {eager:>8.2f} {eager / plain:>6.2f}  (eager)", flush=True)
            for k in (int(x) for x in args.ks.split(",")):
                ms = step_ms(tmp, k, batch, args)
                print(f"{batch:>5} {k:>2} {ms:>8.2f} {ms / plain:>6.2f}", flush=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    raise SystemExit(0 if run(parser.parse_args()) else 1)


if __name__ == "__main__":
    main()
