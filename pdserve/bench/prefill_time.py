"""One prompt's prefill time (time to the first token, offline) at a few prompt lengths.

    python -m pdserve.bench.prefill_time [--lens 256,1024,2000] [--repeats 3] [--dtype auto]
    python -m pdserve.bench.prefill_time --ab-dense   # GGUF on the CPU: dense path vs int4 GEMM

`LLM(model, dtype, max_model_len, kv_cache_memory)` with prefix caching off, then for each
length in `--lens`, `--repeats` fresh prompts of seeded random token ids, each alone through
`LLM.generate(max_tokens=1)`; the report keeps every time and the best of each length (the
least disturbed by other processes). An untimed 3-token request first builds what the first
step builds. An A/B of two commits runs this module from each checkout in turn
(`python -m` puts the working directory first on the path). `--ab-dense` alternates, prompt
by prompt in one engine, the packed int4 GEMMs' dense path for long steps
(engine/quant/int4_dense.py) with the int4 GEMM alone (its threshold out of reach): the two in
the same run, as the box's load moves both alike.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lens", default="256,1024,2000", help="prompt lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ab-dense", action="store_true",
                   help="alternate the int4 GEMMs' dense path with the int4 GEMM alone")
    p.add_argument("--output-json", default="bench_results/prefill_time.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.quant import kernels
    from engine.quant.int4_dense import DENSE_MIN_TOKENS
    from pdserve import LLM, SamplingParams

    lens = [int(n) for n in args.lens.split(",")]
    if not lens or min(lens) < 1 or args.repeats < 1:
        raise ValueError("--lens must be positive integers and --repeats >= 1")
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=max(lens) + 1,
              kv_cache_memory=args.kv_cache_mib << 20, enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], one, use_tqdm=False)
    rng, vocab = random.Random(args.seed), llm.llm_engine.vocab_size
    ways = {"dense": DENSE_MIN_TOKENS, "int4": 1 << 62} if args.ab_dense else {"default": None}
    times: dict[str, dict[int, list[float]]] = {way: {} for way in ways}
    try:
        for n in lens:
            for _ in range(args.repeats):
                for way, threshold in ways.items():
                    prompt = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]}]
                    if threshold is not None:
                        kernels.DENSE_MIN_TOKENS = threshold
                    start = time.perf_counter()
                    llm.generate(prompt, one, use_tqdm=False)
                    times[way].setdefault(n, []).append(time.perf_counter() - start)
    finally:  # the threshold is the module's for every later engine in the process
        kernels.DENSE_MIN_TOKENS = DENSE_MIN_TOKENS
    best = {way: {n: min(t) for n, t in by_len.items()} for way, by_len in times.items()}
    for way, by_len in times.items():
        for n in lens:
            print(f"{way:>8} {n:>6} tokens  best {best[way][n] * 1e3:8.1f} ms  "
                  f"({', '.join(f'{t * 1e3:.1f}' for t in by_len[n])})")
    report = {"config": config_of(args), "seconds": times, "best_s": best}
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("prefill_time", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
