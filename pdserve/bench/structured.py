"""The cost of structured outputs per decode step, against unconstrained decoding in one run.

    python -m pdserve.bench.structured [--device cpu|cuda] [--batches 1,64] [--tokens 64]
                                       [--model PATH | --random-1b | --random-shape 1b|8b]
                                       [--tokenizer DIR] [--json PATH]

Each batch size runs the same prompts twice on one loaded `LLM`, unconstrained and under a JSON
schema (an array of at least `tokens` integers: it cannot end early, so both runs decode the
same number of steps), sampled at temperature 0.8 (unseeded), alternating for `--rounds`
rounds; a step's time is the run's wall time over its decode steps. Reported: ms per step both
ways (medians), the overhead (their ratio, and the median of each round's pair), each round's
times, and the parts measured by the engine (the host's bitmask fill; the grammar compile,
cached after the first round). A constrained step's sampling waits for the step before to be
appended (engine/structured/manager.py's NOTE): the overhead includes what overlap that loses.
`--random-1b` builds the Llama-3.2-1B shape in bf16 over a real tokenizer's vocabulary
(`--tokenizer`, the bundled SmolLM2 by default), for the GPU; `--random-shape 8b` the
Llama-3.1-8B shape (pdserve/bench/gpu_tp.py SHAPES), whose steps are bound by the GPU rather
than by the host.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.structured.params import StructuredOutputsParams
from pdserve import LLM, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    p.add_argument("--random-1b", action="store_true", help="random 1B-shaped model (GPU)")
    p.add_argument("--random-shape", choices=("1b", "8b"), default=None,
                   help="random model of this shape (GPU); --random-1b is --random-shape 1b")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for --random-1b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the report here")


def random_1b(tokenizer_dir: str | None, folder: Path, shape: str = "1b") -> str:
    """The shape (1B by default) over the tokenizer's vocabulary, tokenizer files copied
    beside it."""
    import dataclasses

    from transformers import AutoTokenizer

    from engine.model_loader import load_tokenizer, resolve_model
    from pdserve.bench.gpu_model import save_random_model
    from pdserve.bench.gpu_tp import SHAPES

    tok = (AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir
           else load_tokenizer(resolve_model(None)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    save_random_model(dataclasses.replace(SHAPES[shape], vocab=len(tok)), folder, 0, device)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    tok.save_pretrained(folder)
    return str(folder)


def _schema(tokens: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer"}, "minItems": tokens}


def _run(llm: LLM, batch: int, tokens: int, so: StructuredOutputsParams | None) -> float:
    """Seconds per decode step of one run of `batch` requests of `tokens` tokens."""
    prompts = [f"List {batch} numbers, request {i}:" for i in range(batch)]
    params = SamplingParams(temperature=0.8, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=so)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return wall / tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-structured-"))
    try:
        shape = args.random_shape or ("1b" if args.random_1b else None)
        model = random_1b(args.tokenizer, tmp, shape) if shape else args.model
        llm = LLM(model, device=args.device, max_model_len=1024, max_num_seqs=256)
        engine = llm.llm_engine
        so = StructuredOutputsParams(json=_schema(args.tokens))
        report: dict[str, Any] = {"device": str(engine.runner.device), "tokens": args.tokens,
                                  "batches": {}}
        for batch in (int(b) for b in args.batches.split(",")):
            _run(llm, batch, args.tokens, None)  # warm-up: shapes, kernels, the compile
            _run(llm, batch, args.tokens, so)
            free, constrained, fill = [], [], []
            for _ in range(args.rounds):
                free.append(_run(llm, batch, args.tokens, None))
                before = engine.structured().stats.bitmask_seconds
                constrained.append(_run(llm, batch, args.tokens, so))
                fill.append((engine.structured().stats.bitmask_seconds - before) / args.tokens)
            f, c = statistics.median(free), statistics.median(constrained)
            pairs = [b / a - 1 for a, b in zip(free, constrained, strict=True)]
            report["batches"][batch] = {
                "unconstrained_ms_per_step": f * 1e3, "constrained_ms_per_step": c * 1e3,
                "overhead": c / f - 1, "bitmask_fill_ms_per_step": statistics.median(fill) * 1e3,
                # each round's pair (run back to back): steadier than the medians' ratio where
                # the machine's speed drifts between rounds
                "overhead_median_of_rounds": statistics.median(pairs),
                "rounds_ms": [[a * 1e3, b * 1e3] for a, b in zip(free, constrained, strict=True)],
            }
        stats = engine.structured().stats
        report["compile_ms"] = stats.compile_seconds / max(stats.compiles, 1) * 1e3
        _print(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _print(report: dict[str, Any]) -> None:
    print(f"structured outputs on {report['device']}, {report['tokens']} tokens per request, "
          f"compile {report['compile_ms']:.1f} ms")
    print("batch  free ms/step  json ms/step  overhead  per round  bitmask fill ms/step")
    for batch, r in report["batches"].items():
        print(f"{batch:>5}  {r['unconstrained_ms_per_step']:>12.3f}  "
              f"{r['constrained_ms_per_step']:>12.3f}  {r['overhead']:>+8.1%}  "
              f"{r['overhead_median_of_rounds']:>+9.1%}  {r['bitmask_fill_ms_per_step']:>10.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args())
