"""One benchmark command for the GPU: ceilings, kernels, throughput, latency, tensor parallelism.

    pdserve bench gpu [--parts ceilings,kernels,throughput,latency,tp] [--json PATH] [--small]

  ceilings    device-to-device copy bandwidth and a bf16 8192^3 matmul    (gpu_kernels.py)
  kernels     paged decode / prefill attention vs SDPA; RMSNorm, SiLU-mul and rotary vs eager
  throughput  256 requests of 128-512 prompt and 128 output tokens on a random Llama-3.2-1B
              shape (gpu_model.py): pdserve `LLM.generate` (3 runs on fresh prompts, each with
              its roofline ratio: `--throughput-runs`) vs HF padded `generate` and HF
              `generate_batch`, and the roofline at the measured ceilings  (gpu_generation.py)
  latency     batch-1 decode, ms per token, against the weights-read floor; `--gemv-ab` also
              times an engine with decode_gemv=False (cuBLAS GEMVs, separate SiLU) after it
  tp          for 2+ GPUs, not run unless asked: TP=2 against TP=1 on the 1B shape (or the 8B
              one, `--tp-shape 8b`): greedy tokens identical, batch-1 latency, throughput of 64
              requests, their ratios  (gpu_tp.py; skipped on fewer than 2 GPUs)

Defaults are the issue's full sizes, sized to fit one 10-minute device call on an H100 (HF runs
on the first 128 / 256 requests). `--small` shrinks everything to check the code on a CPU. On the
device, from the checkout: `PYTHONPATH=. python -m pdserve.bench.gpu` (needs only torch, triton
and transformers; the `pdserve` script also imports the services' gRPC and web stacks).

NOTE: the parts run in the order ceilings, kernels, latency, throughput, tp (latency and
throughput share one loaded `LLM`; throughput then frees it for HF; tp loads its own) and the
JSON report is rewritten after each, so a call cut short still leaves what finished. A part that
raises is reported as its error and the next one runs. The table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_generation import measure_latency, measure_throughput
from pdserve.bench.gpu_kernels import (
    SMALL_KERNELS,
    KernelSizes,
    kernels_unavailable,
    measure_ceilings,
    measure_kernels,
)
from pdserve.bench.gpu_model import SMALL_MODEL, ModelSizes, RandomModel, free_device_memory, log
from pdserve.bench.gpu_tp import SHAPES, measure_tp, tp_lines, tp_sizes
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.throughput import _environment, parse_range

PARTS = ("ceilings", "kernels", "throughput", "latency", "tp")
DEFAULT_PARTS = PARTS[:-1]  # tp wants 2+ GPUs and a call of its own
RUN_ORDER = ("ceilings", "kernels", "latency", "throughput", "tp")
# flags that override one size of the preset (--small or the full sizes)
KERNEL_FLAGS = ("copy_mib", "matmul_n")
MODEL_FLAGS = ("num_requests", "input_len_range", "output_len", "max_num_seqs",
               "hf_padded_requests", "hf_batch_size", "hf_cb_requests")


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"parts are a comma list of {','.join(PARTS)}")
    return parts


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to `parser` (shared by `pdserve bench gpu`)."""
    parser.add_argument("--parts", type=_parts, default=DEFAULT_PARTS, metavar=",".join(PARTS))
    parser.add_argument("--small", action="store_true", help="tiny sizes, to check it on a CPU")
    parser.add_argument("--json", default=None,
                        help="report path (default: $OUT/bench_gpu.json, else bench_results/)")
    parser.add_argument("--device", default="auto", help="auto: cuda when there is one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=None,
                        help="keep the random model here (reused when it holds one)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="pdserve's per-step token budget (vLLM's offline default on an "
                             "80 GB GPU; 0: the engine's own default)")
    parser.add_argument("--no-tqdm", action="store_true", help="hide pdserve's progress bar")
    parser.add_argument("--throughput-runs", type=_positive, default=3,
                        help="throughput: pdserve runs, each on fresh prompts (the first one is "
                             "compared with HF)")
    parser.add_argument("--gemv-ab", action="store_true",
                        help="latency: also time decode_gemv=False (the engine before the decode "
                             "GEMV) on a second LLM, after the first")
    parser.add_argument("--tp-eager", action="store_true",
                        help="part tp: TP=2 runs eagerly (enforce_eager) instead of from CUDA "
                             "graphs")
    parser.add_argument("--tp-shape", choices=sorted(SHAPES), default="1b",
                        help="the tp part's model: Llama-3.2-1B's or Llama-3.1-8B's shape")
    sizes = parser.add_argument_group("sizes (default: the issue's, or --small's)")
    for name in KERNEL_FLAGS + MODEL_FLAGS:
        kind = parse_range if name == "input_len_range" else int
        sizes.add_argument("--" + name.replace("_", "-"), type=kind, default=None)


def resolve_sizes(args: argparse.Namespace) -> tuple[KernelSizes, ModelSizes]:
    """The preset (`--small` or full) with the size flags given on the command line."""
    kernels, model = (SMALL_KERNELS, SMALL_MODEL) if args.small else (KernelSizes(), ModelSizes())
    given = {n: getattr(args, n) for n in KERNEL_FLAGS + MODEL_FLAGS
             if getattr(args, n) is not None}
    for name, value in given.items():
        if isinstance(value, int) and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    kernels = dataclasses.replace(kernels, **{n: given[n] for n in KERNEL_FLAGS if n in given})
    model = dataclasses.replace(model, **{n: given[n] for n in MODEL_FLAGS if n in given})
    return kernels, model


def report_path(args: argparse.Namespace) -> str:
    if args.json:
        return args.json
    out = os.environ.get("OUT")
    return str(Path(out) / "bench_gpu.json") if out else "bench_results/bench_gpu.json"


def _run_part(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`fn()` with its seconds; its exception as {"error": ...} (the traceback goes to stderr)."""
    log(f"== {name}")
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # one part failing must not lose the others
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    free_device_memory()
    result["elapsed_s"] = time.perf_counter() - start
    log(f"== {name}: {result['elapsed_s']:.1f} s")
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected parts, rewriting the JSON report after each; print the table last."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    kernel_sizes, model_sizes = resolve_sizes(args)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    start, path = time.perf_counter(), report_path(args)
    report: dict[str, Any] = {
        "config": config_of(args),
        "sizes": {"kernels": dataclasses.asdict(kernel_sizes),
                  "model": dataclasses.asdict(model_sizes)},
        "environment": environment(device),
    }

    def save(name: str, result: dict[str, Any]) -> None:
        """The report so far to `path` (a part still running has no elapsed_s yet)."""
        report[name] = result
        report["elapsed_s"] = time.perf_counter() - start
        write_report(report, path)

    models = RandomModel(model_sizes, device, args.seed, args.model_dir,
                         _llm_kwargs(args, device, model_sizes))
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "ceilings": lambda: measure_ceilings(device, torch.bfloat16, kernel_sizes),
        "kernels": lambda: _kernels(device, kernel_sizes),
        "latency": lambda: _latency(models, report.get("ceilings"), args),
        "throughput": lambda: measure_throughput(
            models, report.get("ceilings"), args.seed, not args.no_tqdm,
            checkpoint=lambda partial: save("throughput", partial), runs=args.throughput_runs),
        "tp": lambda: measure_tp(
            tp_sizes(args.small, args.tp_shape), device, args.seed, args.model_dir,
            args.max_num_batched_tokens, not args.no_tqdm,
            checkpoint=lambda partial: save("tp", partial), tp_eager=args.tp_eager),
    }
    try:
        for name in _run_order(args.parts):
            save(name, _run_part(name, parts[name]))
    finally:
        models.remove()
    print(format_table(report), flush=True)
    return report


def _latency(models: RandomModel, ceilings: dict | None, args: argparse.Namespace
             ) -> dict[str, Any]:
    """Batch-1 latency; with `--gemv-ab` then that of an LLM loaded with decode_gemv=False (the
    first closed before: each sizes its KV cache from free memory), under "cublas"."""
    result = measure_latency(models, ceilings, args.seed)
    model = models.llm().llm_engine.runner.model
    result["decode_gemv_plan"] = getattr(model, "decode_gemv_report", None)  # CUDA only
    if not args.gemv_ab or models.device.type != "cuda":
        return result
    kwargs = models.llm_kwargs
    models.close_llm()
    models.llm_kwargs = {**kwargs, "decode_gemv": False}
    try:
        result["cublas"] = measure_latency(models, ceilings, args.seed)
    finally:
        models.close_llm()
        models.llm_kwargs = kwargs
    return result


def _run_order(selected: tuple[str, ...]) -> list[str]:
    """The selected parts in RUN_ORDER, with the ceilings whenever a roofline needs them."""
    wanted = set(selected) | ({"ceilings"} if {"throughput", "latency"} & set(selected) else set())
    return [name for name in RUN_ORDER if name in wanted]


def _llm_kwargs(args: argparse.Namespace, device: torch.device, sizes: ModelSizes) -> dict:
    kwargs = dict(dtype="bfloat16", device=str(device), seed=args.seed,
                  max_num_seqs=sizes.max_num_seqs, kv_cache_memory=sizes.kv_cache_memory)
    if args.max_num_batched_tokens and device.type == "cuda":
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


def _kernels(device: torch.device, sizes: KernelSizes) -> dict[str, Any]:
    why = kernels_unavailable(device)
    if why is not None:
        log(f"kernels: skipped: {why}")
        return {"skipped": why}
    return measure_kernels(device, torch.bfloat16, sizes)


def environment(device: torch.device) -> dict[str, Any]:
    env = _environment(device)
    try:
        import triton

        env["triton_version"] = triton.__version__
    except ImportError:
        env["triton_version"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                   sms=props.multi_processor_count, cuda=torch.version.cuda)
    return env


# ---- table ---------------------------------------------------------------------------------------
def _num(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, Any]) -> str:
    """The report as text: one block per part that ran."""
    env = report["environment"]
    lines = [f"pdserve bench gpu | {env.get('gpu', env['device'])} | torch "
             f"{env['torch_version']}, triton {env['triton_version']}, transformers "
             f"{env['transformers_version']} | {report.get('elapsed_s', 0):.0f} s"]
    for name in PARTS:
        if name in report:
            part = report[name]
            lines.append(f"\n[{name}] {part['elapsed_s']:.1f} s")
            if "error" in part or "skipped" in part:
                lines.append(f"  {part.get('error') or 'skipped: ' + part['skipped']}")
            else:
                lines += PART_LINES[name](part)
    return "\n".join(lines)


def _ceilings_lines(c: dict[str, Any]) -> list[str]:
    return [f"  copy {c['copy_bytes_per_s'] / 1e12:.3f} TB/s ({c['copy_bytes'] / 2**30:.2f} GiB "
            f"moved in {c['copy_ms']:.3f} ms) | {c['matmul_dtype']} matmul {c['matmul_n']}^3 "
            f"{c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({c['matmul_ms']:.3f} ms)"]


def _kernels_lines(k: dict[str, Any]) -> list[str]:
    lines = [f"  {'kernel':<18}{'shape':<12}{'ours ms':>10}{'ours':>10}{'peer ms':>10}"
             f"{'peer':>10}  {'unit':<8}{'ours/peer':>9}{'rel err':>9}  peer variant"]
    rows = [("decode_attention", f"B{r['batch']} L{r['context']}", r)
            for r in k["decode_attention"]]
    rows += [("prefill_attention", f"S{r['sequences']} L{r['tokens_each']}", r)
             for r in k["prefill_attention"]]
    rows += [(r["kernel"], f"T{r['tokens']}", r) for r in k["fused"]]
    for name, shape, r in rows:
        if "error" in r:
            lines.append(f"  {name:<18}{shape:<12}error: {r['error']}")
            continue
        lines.append(
            f"  {name:<18}{shape:<12} {_num(r.get('ours_ms'), '.4g'):>9}"
            f" {_num(r.get('ours_rate'), '.4g'):>9} {r['peer_ms']:>9.4g} {r['peer_rate']:>9.4g}"
            f"  {r['unit']:<8}{_num(r.get('ratio'), '.2f'):>9}{_num(r.get('rel_err'), '.1e'):>9}"
            f"  {r['peer']}" + (f"  ours: {r['ours_error']}" if "ours_error" in r else ""))
    return lines


def _throughput_lines(t: dict[str, Any]) -> list[str]:
    w = t["workload"]
    lines = [f"  {w['requests']} requests, {w['input_tokens']} prompt + {w['output_tokens']} "
             f"output tokens",
             f"  {'system':<20}{'requests':>9}{'wall s':>9}{'out tok/s':>11}"]
    for name, r in t["systems"].items():
        if "error" in r:
            lines.append(f"  {name:<20}{r['requests']:>9}  error: {r['error']}")
        else:
            lines.append(f"  {name:<20}{r['requests']:>9}{r['wall_s']:>9.2f}"
                         f"{r['output_tokens_per_s']:>11.1f}")
    roof = t.get("roofline")
    if roof is not None:
        seconds = roof["prefill_s"] + roof["decode_s"]
        lines.append(f"  {'roofline':<20}{w['requests']:>9}{seconds:>9.2f}"
                     f"{roof['output_tokens_per_s']:>11.1f}  (prefill {roof['prefill_s']:.3f} s, "
                     f"decode {roof['decode_s']:.3f} s)")
        lines.append(f"  pdserve / roofline   {roof['pdserve_fraction']:.3f}")
    runs = t["systems"].get("pdserve", {}).get("runs", [])
    if len(runs) > 1:
        lines.append("  pdserve runs (out tok/s, / roofline): " + ", ".join(
            f"{r['output_tokens_per_s']:.0f} ({_num(r.get('roofline_fraction'), '.3f')})"
            for r in runs))
    lines += [f"  {name.replace('_over_', ' / '):<20} {v:.2f}x" for name, v in t["ratios"].items()]
    if "hf_error" in t:
        lines.append(f"  HF: {t['hf_error']}")
    return lines


def _latency_lines(t: dict[str, Any]) -> list[str]:
    return [f"  batch 1, prompt {t['prompt_tokens']}, {t['decode_tokens']} decode tokens: "
            f"{t['ms_per_token']:.3f} ms/token (engine stamps "
            f"{_num(t['ms_per_token_engine_stamps'], '.3f')}), TTFT {t['ttft_ms']:.1f} ms | "
            f"weights floor {_num(t.get('weights_floor_ms'), '.3f')} ms, ratio "
            f"{_num(t.get('over_floor'), '.2f')}"] + (
        [f"  with decode_gemv=False: {t['cublas']['ms_per_token']:.3f} ms/token (engine stamps "
         f"{_num(t['cublas']['ms_per_token_engine_stamps'], '.3f')}), ratio "
         f"{_num(t['cublas'].get('over_floor'), '.2f')}"] if "cublas" in t else [])


PART_LINES = {"ceilings": _ceilings_lines, "kernels": _kernels_lines,
              "throughput": _throughput_lines, "latency": _latency_lines, "tp": tp_lines}


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
