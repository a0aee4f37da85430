"""Speculative decoding (n-gram prompt lookup) against plain decoding, in one run.

    python -m pdserve.bench.spec_decode [--model PATH] [--device cpu] [--k 3] [--batches 1,8]
                                        [--tokens 256] [--rounds 2] [--lengths plain|natural]
                                        [--json PATH]

Two workloads, chat-templated, greedy: "copy" (rewrite a given code snippet or text with a
small change: the answer copies most of the prompt) and "free" (open questions: little to copy).
Each (workload, batch size) runs the same requests on a plain engine and on an ngram engine per
`--k`, alternating for `--rounds` rounds, every other round in reverse order (every prompt of
the workload, in batches of that size one after the other: batch 1 is a single stream over the
four prompts). By default every
request makes as many tokens as the plain engine's untimed answer to it (`--lengths plain`):
both engines do the same work, which natural stops do not guarantee (a near-tie can end an
answer early in one of them, and a batch lasts as long as its longest answer). tok/s is output
tokens over wall time (prefill included; also per CPU-second of this process, steadier where
other work shares the cores), and the acceptance length is tokens emitted per verification
with drafts (1 + the accepted drafts), from the engine's counters. The outputs of both must be
equal (greedy), in every round: `same` says whether they were (with the quantized bundled model
a greedy near-tie can break either way: docs/benchmarks.md). In the JSON, a speculating
engine's row also has `steps`: its timed decode steps by query-token count and whether they
verified drafts ("9 drafted"; count, mean ms) and its planner's cost estimate for each at the
end, what the draft plan went by.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from pdserve import LLM, SamplingParams

INVENTORY = """import json


class Inventory:
    def __init__(self, path):
        self.path = path
        self.items = {}

    def load(self):
        with open(self.path) as f:
            self.items = json.load(f)

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
"""
STATS = """def mean(values):
    if not values:
        raise ValueError("no values")
    return sum(values) / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def summary(values):
    return {"mean": mean(values), "variance": variance(values), "median": median(values)}
"""
LEASE = """Rental agreement, flat 4B, 12 Mill Road.

1. Term. The lease starts on 1 March and runs for twelve months. After that it continues from
month to month until either party ends it.
2. Rent. The rent is 950 euros a month, due on the first day of each month. Rent paid more than
five days late incurs a late fee of 40 euros, and a further 5 euros for each day after that.
3. Deposit. The tenant pays a deposit of two months' rent before moving in. The landlord returns
it within thirty days after the tenant moves out, less the cost of any damage beyond normal wear.
4. Ending the lease. During the first twelve months the tenant may end the lease only by finding
a replacement tenant approved by the landlord. After that the tenant may end it by giving one
month's notice in writing. The landlord must give three months' notice in writing.
5. Pets. No pets are allowed without the landlord's written consent."""
COPY = [
    "Rename the method `total` to `count_all` in this code. Output the whole code.\n\n"
    "```python\n" + INVENTORY + "```",
    "Rename the function `mean` to `average` in this code. Output the whole code.\n\n"
    "```python\n" + STATS + "```",
    "Add type hints to this code. Output the whole code.\n\n```python\n" + INVENTORY + "```",
    "Add a docstring to each function. Output the whole code.\n\n```python\n" + STATS + "```",
    "Answer from the document below, quoting it.\n\n" + LEASE + "\n\nQuestion: what happens "
    "if the rent is paid late, and how can the tenant end the lease?",
]
FREE = [
    "Write a short story about a dragon who learns to cook.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "What are the pros and cons of working from home?",
]


@dataclass
class Row:
    workload: str
    batch: int
    config: str  # "off" or "ngram k=K"
    tokens: int
    seconds: float  # wall time
    cpu_seconds: float  # this process's CPU time (all threads): steadier on a shared box
    acceptance_length: float | None
    same_output: bool
    steps: dict[str, dict[str, float]] | None = None  # speculating engines: see the NOTE

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tok_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="float32: exact, outputs equal token for token")
    p.add_argument("--k", default="3", help="num_speculative_tokens values, comma-separated")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config's disable_by_batch_size (default: none)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=256, help="max output tokens per request")
    p.add_argument("--lengths", default="plain", choices=["plain", "natural"],
                   help="plain: every request makes as many tokens as the plain engine's "
                        "answer to it (greedy, up to --tokens), with and without speculation: "
                        "the same work; natural: each engine stops where its own answer ends "
                        "(in bf16 near-ties end answers at other lengths, and a batch runs as "
                        "long as its longest request, so tok/s then compares other work)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")


def conversations(workload: str, batch: int) -> list[list[dict[str, str]]]:
    """Every prompt of the workload at least once (a batch smaller than the workload runs it
    as several batches one after the other: one answer's greedy near-ties must not decide a
    single stream's figure), more cycling through them to fill a larger batch."""
    prompts = COPY if workload == "copy" else FREE
    texts = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    return [[{"role": "user", "content": t}] for t in texts]


def run_once(llm: LLM, convs: list, params: list[SamplingParams], batch: int
             ) -> tuple[list, float, float]:
    """`convs` in batches of `batch` at once, one batch after the other (`params`: each
    conversation's)."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = [o for i in range(0, len(convs), batch)
            for o in llm.chat(convs[i:i + batch], params[i:i + batch], use_tqdm=False)]
    took = time.perf_counter() - start, time.process_time() - cpu
    return [o.outputs[0].token_ids for o in outs], *took


def measure(
    engines: dict[str, LLM], workload: str, batch: int, args: argparse.Namespace
) -> list[Row]:
    convs = conversations(workload, batch)
    for llm in engines.values():  # warm-up: first-call costs out of the timings
        llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=args.tokens)] * len(convs)
    if args.lengths == "plain":  # the plain engine's answer lengths, for every engine
        answers, _, _ = run_once(engines["off"], convs, params, batch)
        params = [SamplingParams(temperature=0, max_tokens=len(a), ignore_eos=True)
                  for a in answers]
    seconds = dict.fromkeys(engines, 0.0)
    cpu_seconds = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    outputs: dict[str, list] = {name: [] for name in engines}  # every round's
    before = {name: llm.llm_engine.stats() for name, llm in engines.items()}
    steps = {name: _watch_steps(llm) for name, llm in engines.items()}
    for round_ in range(args.rounds):
        order = list(engines.items())
        for name, llm in order[::-1] if round_ % 2 else order:  # ABBA: a drift cancels
            ids, took, cpu = run_once(llm, convs, params, batch)
            seconds[name] += took
            cpu_seconds[name] += cpu
            tokens[name] += sum(len(t) for t in ids)
            outputs[name].append(ids)
    rows = []
    for name, llm in engines.items():
        s, b = llm.llm_engine.stats(), before[name]
        drafts = s.spec_decode_num_drafts - b.spec_decode_num_drafts
        taken = s.spec_decode_num_accepted_tokens - b.spec_decode_num_accepted_tokens
        rows.append(
            Row(
                workload,
                batch,
                name,
                tokens[name],
                seconds[name],
                cpu_seconds[name],
                1 + taken / drafts if drafts else None,
                outputs[name] == outputs["off"],
                _step_summary(llm, steps[name]),
            )
        )
    return rows


def _watch_steps(llm: LLM) -> list[tuple[int, bool, float]] | None:
    """Record a speculating engine's decode steps (query tokens, verified drafts or not,
    seconds) from now on, as its planner sees them; None for a plain engine."""
    planner = llm.llm_engine.planner
    if planner is None:
        return None
    seen: list[tuple[int, bool, float]] = []
    measured = planner.measured

    def watched(out: Any, seconds: float) -> None:
        seen.append((sum(s.num_new_tokens for s in out.scheduled),
                     any(s.spec_token_ids for s in out.scheduled), seconds))
        measured(out, seconds)

    planner.measured = watched
    return seen


def _step_summary(llm: LLM, seen: list[tuple[int, bool, float]] | None
                  ) -> dict[str, dict[str, float]] | None:
    """By kind of step ("8": 8 query tokens, plain; "9 drafted": 9 with drafts verified)."""
    if seen is None:
        return None
    del llm.llm_engine.planner.measured  # the class's own again
    by: dict[tuple[int, bool], list[float]] = {}
    for tokens, drafted, seconds in seen:
        by.setdefault((tokens, drafted), []).append(seconds)
    estimate = llm.llm_engine.planner.costs.estimate
    return {f"{t} drafted" if d else str(t):
            {"steps": len(s), "mean_ms": 1e3 * sum(s) / len(s),
             "planned_ms": 1e3 * (estimate(t, d) or float("nan"))}
            for (t, d), s in sorted(by.items())}


def run(args: argparse.Namespace) -> bool:
    common: dict[str, Any] = dict(
        device=args.device, dtype=args.dtype, max_model_len=2048, kv_cache_memory=256 << 20
    )
    engines = {"off": LLM(args.model, **common)}
    for k in (int(x) for x in args.k.split(",")):
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
            "disable_by_batch_size": args.disable_by_batch_size,
        }
        engines[f"ngram k={k}"] = LLM(args.model, speculative_config=spec, **common)
    rows: list[Row] = []
    print(
        f"{'workload':9} {'batch':>5} {'config':12} {'tokens':>7} {'tok/s':>8} {'speed-up':>8} "
        f"{'tok/cpu-s':>9} {'speed-up':>8} {'accept len':>10} same"
    )
    for workload in ("copy", "free"):
        for batch in (int(x) for x in args.batches.split(",")):
            got = measure(engines, workload, batch, args)
            base, cpu_base = got[0].tok_s, got[0].tok_cpu_s
            for r in got:
                acc = "-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}"
                cpu = f"{r.tok_cpu_s:>9.1f} {r.tok_cpu_s / cpu_base:>7.2f}x"
                print(
                    f"{r.workload:9} {r.batch:>5} {r.config:12} {r.tokens:>7} {r.tok_s:>8.1f} "
                    f"{r.tok_s / base:>7.2f}x {cpu} {acc:>10} {r.same_output}"
                )
            rows += got
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [asdict(r) | {"tok_s": r.tok_s, "tok_cpu_s": r.tok_cpu_s} for r in rows],
                f,
                indent=2,
            )
    return all(r.same_output for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    raise SystemExit(0 if run(parser.parse_args()) else 1)


if __name__ == "__main__":
    main()
