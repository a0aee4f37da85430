"""Where `LLM()`'s resident memory goes, call by call, on the CPU.

    python -m pdserve.bench.rss_calls [--model X.gguf] [--kv-cache-mib 16] [--max-model-len 256]

NOTE: how. The process's VmRSS is read before and after every Python call made while `LLM()`
is built (a `sys.setprofile` hook: the load runs several times slower, its memory is the same),
and each call of the repository's code whose return finds the process at least `--min-mib`
larger is kept with its depth. A parent's growth includes its children's; a call's growth can
be smaller than what it allocates where it reuses memory an earlier call freed (glibc keeps
freed heap for the next allocations: a tokenizer's parse garbage becomes the weights' home).
Beside the calls: VmRSS after `import torch` and pdserve's imports, RssAnon / RssFile at the end
(file pages are shared libraries' code and data read so far), and the model's weight bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report

REPO = str(Path(__file__).resolve().parents[2])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model path (default: the bundled GGUF)")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--kv-cache-mib", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--depth", type=int, default=5, help="the deepest call reported")
    parser.add_argument("--min-mib", type=float, default=1.0, help="the least growth reported")
    parser.add_argument("--codec-alone", action="store_true",
                        help="instead: the text codec alone, and what malloc_trim hands back")
    parser.add_argument("--output-json", default="bench_results/rss_calls.json")


def status_mib(*keys: str) -> dict[str, float]:
    """Fields of /proc/self/status in MiB (VmRSS, RssAnon, RssFile, ...)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in keys:
                out[name] = int(line.split()[1]) / 1024
    return out


def rss_mib() -> float:
    """This process's resident memory (VmRSS) in MiB."""
    with open("/proc/self/statm") as f:  # (resident pages: the cheapest read of VmRSS)
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def calls_growth(build: Any, min_mib: float, depth: int,
                 root: str = REPO) -> tuple[Any, list[dict[str, Any]]]:
    """`build()` under the profile hook: its result and the calls of code under `root` (the
    repository) that grew the process by `min_mib` or more, in the order they returned, with
    their depth."""
    starts: list[float] = []
    kept: list[dict[str, Any]] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            starts.append(rss_mib())
        elif event == "return" and starts:
            grown = rss_mib() - starts.pop()
            code = frame.f_code
            if grown >= min_mib and len(starts) <= depth and code.co_filename.startswith(root):
                where = os.path.relpath(code.co_filename, root)
                kept.append({"depth": len(starts), "mib": round(grown, 1),
                             "call": f"{where}:{code.co_name}"})

    sys.setprofile(hook)
    try:
        result = build()
    finally:
        sys.setprofile(None)
    return result, kept


def codec_alone(model: str) -> dict[str, float]:
    """VmRSS (MiB) before and after loading `model`'s text codec alone, and after glibc's
    `malloc_trim(0)` returns the free heap: what the codec keeps and what its load leaves."""
    import ctypes

    from engine.model_loader import load_text_codec

    stages = {"before": rss_mib()}
    codec = load_text_codec(model)
    stages["loaded"] = rss_mib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    stages["trimmed"] = rss_mib()
    assert codec is not None, "the model has no plain tokenizers codec"
    return stages


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.codec_alone:
        from engine.model_loader import resolve_model

        model = resolve_model(args.model)
        stages = codec_alone(model)
        print({k: round(v, 1) for k, v in stages.items()})
        report = {"config": config_of(args), "model": model, "codec_alone": stages}
        write_report(report, args.output_json)
        return report
    stages = {"start": rss_mib()}
    import torch

    stages["torch"] = rss_mib()
    from engine.model_loader import resolve_model
    from pdserve import LLM
    from pdserve.bench.cpu_gguf import _weights_bytes

    stages["pdserve"] = rss_mib()
    model = resolve_model(args.model)

    def build() -> Any:
        return LLM(model, quantization=args.quantization, kv_cache_memory=args.kv_cache_mib << 20,
                   max_model_len=args.max_model_len, device="cpu")

    with torch.inference_mode():
        llm, calls = calls_growth(build, args.min_mib, args.depth)
    stages["engine"] = rss_mib()
    report = {"config": config_of(args), "model": model, "rss_stages": stages,
              "end": status_mib("VmRSS", "RssAnon", "RssFile"),
              "weights_mib": _weights_bytes(llm.llm_engine.runner.model) / 2**20, "calls": calls}
    for name, mib in stages.items():
        print(f"{name:>8} {mib:7.1f} MiB")
    for call in calls:
        print(f"{'  ' * call['depth']}{call['mib']:6.1f}  {call['call']}")
    print("end", {k: round(v, 1) for k, v in report["end"].items()},
          f"weights {report['weights_mib']:.1f} MiB")
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("rss_calls", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
