"""Offline throughput: pdserve's continuous batching against HF transformers on the same requests.

    python -m pdserve.bench.throughput [--num-prompts 32] [--skip-hf-sequential] ...

NOTE: the workload. `--num-prompts` requests, each a prompt of seeded random token ids drawn
uniformly from the vocabulary minus the tokenizer's special/added tokens (length uniform in
`--input-len-range`), and one output length uniform in `--output-len-range`. Random ids, not
text: no dataset to ship, identical across tokenizer versions, and no two prompts share a prefix,
so pdserve's prefix cache gives it nothing. Every request is greedy and generates exactly its
length (pdserve: `ignore_eos`; HF: `min_new_tokens` = `max_new_tokens`, padding with eos).

Three systems run, one after the other, in one process with one torch thread count:

  pdserve        `LLM.generate` on all prompts at once (after an untimed warm-up)
  hf_padded      one left-padded `model.generate` batch; every row runs to the longest output
  hf_sequential  `model.generate` on one prompt at a time (`--skip-hf-sequential` skips it)

Throughput counts only useful tokens: each request's prompt and its requested output. The
padded batch's padding and its tokens past a row's own length are work, not output.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pdserve.bench.report import bench_main, config_of, write_report

if TYPE_CHECKING:
    from pdserve import LLM

SYSTEMS = ("pdserve", "hf_padded", "hf_sequential")
T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class Measurement:
    seconds: float
    cpu_seconds: float  # process CPU time; well below threads x seconds: others shared the CPUs
    tokens: list[list[int]]  # each request's output (a padded row cut to the request's length)
    generated_tokens: int  # every token the system generated, useful or not


# ---- command line -------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    """'16-256' -> (16, 256); both ends included. Raises ValueError on a bad range."""
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"a range is LOW-HIGH, e.g. 16-256; got {text!r}")
    lo, hi = int(low), int(high)
    if not 1 <= lo <= hi:
        raise ValueError(f"a range needs 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to `parser` (shared by `pdserve bench throughput`)."""
    parser.add_argument("--model", default=None, help="local HF folder or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len-range", type=parse_range, default=(16, 256), metavar="LO-HI")
    parser.add_argument("--output-len-range", type=parse_range, default=(32, 128), metavar="LO-HI")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's own")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf-sequential", action="store_true")
    parser.add_argument("--output-json", default="bench_results/throughput.json")
    parser.add_argument("--no-tqdm", action="store_true", help="hide pdserve's progress bar")


# ---- workload -----------------------------------------------------------------------------------
def make_workload(
    tokenizer: Any, num_prompts: int, input_range: tuple[int, int],
    output_range: tuple[int, int], seed: int,
) -> Workload:
    """Seeded prompts of random non-special token ids and one output length per request."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(seed)
    prompts = [rng.choices(vocab, k=rng.randint(*input_range)) for _ in range(num_prompts)]
    output_lens = [rng.randint(*output_range) for _ in range(num_prompts)]
    return Workload(prompts, output_lens)


def _timed(fn: Callable[[], T], device: torch.device | None = None) -> tuple[T, float, float]:
    """`fn()` with its wall and process-CPU seconds (a CUDA `device` synchronized at both ends)."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - wall, time.process_time() - cpu


# ---- systems ------------------------------------------------------------------------------------
def bench_pdserve(llm: LLM, workload: Workload, use_tqdm: bool) -> Measurement:
    """All prompts in one `LLM.generate`, after an untimed warm-up on a prompt of its own."""
    from pdserve import SamplingParams

    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": workload.prompts[0][:3]}], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    # outputs come back as Python lists: nothing is left running on the device
    outputs, seconds, cpu = _timed(lambda: llm.generate(prompts, params, use_tqdm=use_tqdm))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return Measurement(seconds, cpu, tokens, sum(len(t) for t in tokens))


def _hf_generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, pad: int) -> Any:
    return model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
        pad_token_id=pad,
    )


@torch.inference_mode()
def bench_hf_padded(model: Any, workload: Workload, pad_id: int) -> Measurement:
    """One left-padded batch, greedy, run until the longest requested output is done."""
    device, width = model.device, max(len(p) for p in workload.prompts)
    rows = [[pad_id] * (width - len(p)) + p for p in workload.prompts]
    masks = [[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts]
    ids = torch.tensor(rows, device=device)  # [B, width]
    mask = torch.tensor(masks, device=device)  # [B, width]
    longest = max(workload.output_lens)
    _hf_generate(model, ids[:1, -4:], mask[:1, -4:], 2, pad_id)  # warm-up, untimed
    run = lambda: _hf_generate(model, ids, mask, longest, pad_id)  # [B, width + longest]
    out, seconds, cpu = _timed(run, device)
    new = out[:, width:].tolist()
    tokens = [row[:n] for row, n in zip(new, workload.output_lens, strict=True)]
    return Measurement(seconds, cpu, tokens, len(rows) * longest)


@torch.inference_mode()
def bench_hf_sequential(model: Any, workload: Workload, pad_id: int) -> Measurement:
    """One `generate` per prompt, each run to exactly its own output length."""

    def one(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt], device=model.device)  # [1, len]
        return _hf_generate(model, ids, torch.ones_like(ids), n, pad_id)[0, len(prompt):].tolist()

    pairs = zip(workload.prompts, workload.output_lens, strict=True)
    tokens, seconds, cpu = _timed(lambda: [one(p, n) for p, n in pairs], model.device)
    return Measurement(seconds, cpu, tokens, sum(len(t) for t in tokens))


# ---- report -------------------------------------------------------------------------------------
def summarize(m: Measurement, workload: Workload) -> dict[str, Any]:
    """Seconds and throughput of one system; tokens past a request's own length do not count."""
    useful = sum(min(len(t), n) for t, n in zip(m.tokens, workload.output_lens, strict=True))
    total = workload.input_tokens + useful
    return {
        "wall_s": m.seconds,
        "cpu_s": m.cpu_seconds,
        "output_tokens": useful,
        "generated_tokens": m.generated_tokens,
        "total_tokens": total,
        "output_tokens_per_s": useful / m.seconds,
        "total_tokens_per_s": total / m.seconds,
    }


def match_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose token lists are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _ratio(systems: dict[str, dict[str, Any]], other: str) -> float | None:
    ours, theirs = systems["pdserve"], systems.get(other)
    return None if theirs is None else ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],  # other processes skew CPU timings
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def format_table(report: dict[str, Any]) -> str:
    """The report as a readable text table."""
    w, env, s = report["workload"], report["environment"], report["systems"]
    lines = [
        f"{w['num_prompts']} requests, {w['input_tokens']} prompt + {w['output_tokens']} output "
        f"tokens | {env['device']}, {env['torch_threads']} torch threads of {env['cpu_count']} "
        f"CPUs (load {env['load_avg_1m_at_start']:.1f}), torch {env['torch_version']}",
        f"{'system':<15}{'wall s':>9}{'cpu s':>9}{'out tok/s':>11}{'total tok/s':>13}"
        f"{'generated':>11}",
    ]
    for name, r in s.items():
        lines.append(
            f"{name:<15}{r['wall_s']:>9.2f}{r['cpu_s']:>9.1f}{r['output_tokens_per_s']:>11.1f}"
            f"{r['total_tokens_per_s']:>13.1f}{r['generated_tokens']:>11}"
        )
    for key, value in {**report["ratios"], **report["sanity"]}.items():
        lines.append(f"{key:<36}{'-' if value is None else format(value, '.3g'):>8}")
    return "\n".join(lines)


# ---- driver -------------------------------------------------------------------------------------
def _run_pdserve(args: argparse.Namespace) -> tuple[Workload, Measurement, frozenset[int]]:
    from pdserve import LLM

    llm = LLM(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )
    workload = make_workload(
        llm.get_tokenizer(), args.num_prompts, args.input_len_range, args.output_len_range,
        args.seed,
    )
    result = _done("pdserve", bench_pdserve(llm, workload, use_tqdm=not args.no_tqdm))
    eos = frozenset(llm.llm_engine.eos_token_ids)
    del llm  # free its KV cache before the HF model loads
    gc.collect()
    return workload, result, eos


def _done(name: str, m: Measurement) -> Measurement:
    print(f"{name}: {m.seconds:.1f} s", file=sys.stderr, flush=True)
    return m


def _run_hf(args: argparse.Namespace, workload: Workload, pad_id: int) -> dict[str, Measurement]:
    from engine.model_loader import load_hf_model, resolve_model

    model = load_hf_model(resolve_model(args.model), getattr(torch, args.dtype))
    model.to(torch.device(args.device))
    results = {"hf_padded": _done("hf_padded", bench_hf_padded(model, workload, pad_id))}
    if not args.skip_hf_sequential:
        seq = bench_hf_sequential(model, workload, pad_id)
        results["hf_sequential"] = _done("hf_sequential", seq)
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark for parsed `args`, print the table, write the JSON report; return it."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start, environment = time.perf_counter(), _environment(torch.device(args.device))
    workload, pd_result, eos = _run_pdserve(args)
    results = {"pdserve": pd_result, **_run_hf(args, workload, min(eos))}
    systems = {name: summarize(results[name], workload) for name in SYSTEMS if name in results}
    report = {
        "config": config_of(args),
        "environment": environment,
        "workload": {
            "num_prompts": len(workload.prompts), "input_tokens": workload.input_tokens,
            "output_tokens": workload.output_tokens, "output_lens": workload.output_lens,
        },
        "systems": systems,
        "ratios": {f"pdserve_over_{o}": _ratio(systems, o) for o in SYSTEMS[1:]},
        "sanity": _sanity(results, eos),
        "elapsed_s": time.perf_counter() - start,
    }
    print(format_table(report))
    write_report(report, args.output_json)
    return report


def _sanity(results: dict[str, Measurement], eos: frozenset[int]) -> dict[str, float | None]:
    """Greedy agreement of pdserve with HF, and how many pdserve outputs hold an eos (HF's
    `min_new_tokens` forbids eos; pdserve's `ignore_eos` only keeps going past one)."""
    ours = results["pdserve"].tokens
    return {
        **{f"greedy_match_vs_{name}": match_fraction(ours, results[name].tokens)
           if name in results else None for name in SYSTEMS[1:]},
        "pdserve_requests_emitting_eos": sum(bool(eos & set(t)) for t in ours),
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main("throughput", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
