"""Where a single stream's time goes with and without n-gram speculation, by kind of step.

    python -m pdserve.bench.spec_decode_breakdown [--workload copy] [--k 3] [--tokens 128]

The bundled model (or `--model`), greedy, each prompt of `pdserve.bench.spec_decode`'s workload
alone, one after the other, on a plain engine and an ngram one. Every step is timed from one
`schedule` call to the next and filed as a prefill step (a prompt chunk) or by its query tokens
(q=1: a plain decode, q=k+1: a verification of k drafts). Prints, per engine, the steps of each
kind, their total and mean time, and the ratio of the decode steps' total time to the plain
engine's: the speed-up speculation gives where prefill does not count.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

from pdserve import LLM, SamplingParams
from pdserve.bench.spec_decode import conversations


def timed_steps(llm: LLM) -> list[tuple[float, str]]:
    """Wrap `llm`'s scheduler: each schedule call appends (start time, kind of step)."""
    scheduler = llm.llm_engine.scheduler
    real = scheduler.schedule
    log: list[tuple[float, str]] = []

    def schedule() -> Any:
        out = real()
        prefill = any(s.num_new_tokens > 1 and not s.spec_token_ids for s in out.scheduled)
        q = sum(s.num_new_tokens for s in out.scheduled)
        log.append((time.perf_counter(), "prefill" if prefill else f"q={q}"))
        return out

    scheduler.schedule = schedule  # type: ignore[method-assign]
    return log


def breakdown(llm: LLM, convs: list, params: SamplingParams) -> dict[str, Any]:
    llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    log = timed_steps(llm)
    start = time.perf_counter()
    tokens = [len(llm.chat([c], params, use_tqdm=False)[0].outputs[0].token_ids) for c in convs]
    end = time.perf_counter()
    log.append((end, "end"))
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for (t, kind), (t_next, _) in zip(log, log[1:]):
        kinds[kind][0] += 1
        kinds[kind][1] += t_next - t
    decode = sum(s for kind, (_, s) in kinds.items() if kind.startswith("q="))
    return {"seconds": end - start, "tokens": tokens, "decode_seconds": decode,
            "steps": {k: {"count": n, "seconds": s} for k, (n, s) in sorted(kinds.items())}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    p.add_argument("--workload", choices=("copy", "free"), default="copy")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--tokens", type=int, default=128, help="max output tokens per request")
    args = p.parse_args()
    common: dict[str, Any] = dict(device="cpu", max_model_len=2048, kv_cache_memory=256 << 20)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    convs = conversations(args.workload, 1)
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    plain = None
    for name, extra in (("off", {}), (f"ngram k={args.k}", {"speculative_config": spec})):
        llm = LLM(args.model, **common, **extra)
        got = breakdown(llm, convs, params)
        llm.llm_engine.shutdown()
        plain = plain or got
        decode = got["decode_seconds"]
        print(f"{name}: {got['seconds']:.2f} s for {sum(got['tokens'])} tokens "
              f"({plain['seconds'] / got['seconds']:.2f}x), decode steps "
              f"{decode:.2f} s ({plain['decode_seconds'] / decode:.2f}x)")
        for kind, s in got["steps"].items():
            print(f"  {kind:8} {s['count']:5d} steps {s['seconds']:7.3f} s "
                  f"{1000 * s['seconds'] / s['count']:7.2f} ms each")


if __name__ == "__main__":
    main()
