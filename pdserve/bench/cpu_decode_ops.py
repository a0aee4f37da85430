"""Where a single stream's CPU decode token goes: torch ops a token, by call site, and their time.

    python -m pdserve.bench.cpu_decode_ops [--model X.gguf] [--tokens 20] [--threads 2]

NOTE: at one row a CPU decode step is a few GEMMs over the weights and many small torch ops;
the second kind is what llama.cpp's fused kernels do not pay. `LLM(model)` (the bundled GGUF
kept quantized by default), one prompt of `--prompt-len` ids, then `--tokens` greedy tokens
twice after a warm-up:

  ops_per_token   every aten op the engine dispatches (a `TorchDispatchMode`), per token, and
                  the same by the engine's source line that called it (`--top` of them)
  self_ms         torch.profiler's self CPU time per token of the heaviest aten ops (the
                  profiler's own cost included: read the shares, not the sum)
  ms_per_token    the same generation without either, wall time
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

from pdserve.bench.report import bench_main, config_of, median_wall_ms, write_report

PACKAGES = ("engine/", "kernels/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled one)")
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--top", type=int, default=25, help="call sites and ops listed")
    parser.add_argument("--output-json", default="bench_results/cpu_decode_ops.json")


def _site() -> str:
    """The innermost frame of engine/ or kernels/ below the dispatch."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        for package in PACKAGES:
            at = name.rfind("/" + package)
            if at >= 0:
                return f"{name[at + 1:]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside the engine)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    from pdserve import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, kv_cache_memory=64 << 20, max_model_len=512, device="cpu")
    prompt = [{"prompt_token_ids": list(range(100, 100 + args.prompt_len))}]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def generate() -> None:
        llm.generate(prompt, params, use_tqdm=False)

    ms_per_token = median_wall_ms(generate, repeats=1) / args.tokens  # after one warm-up

    sites: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            sites[_site()] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        generate()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
    per = float(args.tokens)  # the prompt's step counts in every figure alike
    report = {
        "config": config_of(args),
        "ms_per_token": ms_per_token,
        "ops_per_token": sum(sites.values()) / per,
        "sites": {k: v / per for k, v in sites.most_common(args.top)},
        "self_ms": {e.key: e.self_cpu_time_total / 1e3 / per for e in ops},
        "calls_per_token": {e.key: e.count / per for e in ops},
    }
    print(f"{ms_per_token:.2f} ms a token; {report['ops_per_token']:.0f} torch ops a token")
    for site, n in report["sites"].items():
        print(f"  {n:7.1f}  {site}")
    print("self CPU ms a token (under the profiler):")
    for key, ms in report["self_ms"].items():
        print(f"  {ms:7.3f}  {key}  ({report['calls_per_token'][key]:.1f} calls)")
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("cpu_decode_ops", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
