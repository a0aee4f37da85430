"""One prompt's prefill step alone: its wall time against the GPU's busy time, by prompt length.

    python -m pdserve.bench.prefill_step [--shape full|tiny] [--lengths 128,320,512,2048,8192]
        [--repeats 5] [--row-keys 0,262144] [--output-json PATH]

NOTE: why. In the one-H100 load test at 16 req/s (docs/loadtest.md) a step that prefilled one
prompt of 128-512 tokens took 8-19 ms, in the colocated engine and the split's prefill worker
alike, while a burst's step of ~8k tokens took ~35 ms: the time to first token at low load is
mostly that step, and it grows with the machine's host speed, not the prompt. This measures
one prompt at a time on a random model of `--shape` (the 1B shape by default), in an offline
`LLM` (prefix caching off, one prompt per step): `generate([ids], max_tokens=1)` after a warm-up
of each length (the kernels' compilation), `--repeats` times; then twice under torch.profiler:

  wall_ms        the median generate call (the step, its sampling, the engine's bookkeeping)
  gpu_busy_ms    the union of the GPU's kernel and copy intervals in a profiled call (CUDA)
  host_share     1 - gpu_busy / wall: how much of the call the GPU sat idle (CUDA)
  kernels        kernels launched per call (CUDA); cpu_ops: torch ops dispatched per call
  top_self_cpu   the host's 12 busiest event names in a profiled call (self time)

A step whose host_share is high at 128-512 tokens and low at 8192 is bound by launching its
kernels one by one (eager), as a decode step was before its CUDA graphs. `--row-keys`: each
length once per value of the cap on a step's keys read as decode rows (engine/spec_graphs.py's
`prefill_rows_fit`; 0: prompts run eagerly), in one engine: the replay against the eager step.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.spec_graphs import MAX_GRAPH_ROWS
from engine.step_profiler import covered
from pdserve.bench.gpu_model import save_random_model
from pdserve.bench.gpu_serve_plan import SHAPES
from pdserve.bench.report import bench_main, config_of, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="full", choices=sorted(SHAPES))
    parser.add_argument("--lengths", default="128,320,512,2048,8192",
                        help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--row-keys", default=None,
                        help="comma list of DecodeGraphs.row_keys_max values to run each length "
                             "with (default: the engine's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


MAX_LENGTH = 32768


def lengths_of(text: str) -> list[int]:
    """"128,512" -> [128, 512]. Raises ValueError naming --lengths."""
    try:
        lengths = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--lengths: {text!r} is not a comma list of integers") from None
    if not lengths or any(not 1 <= n <= MAX_LENGTH for n in lengths):
        raise ValueError(f"--lengths: each in 1..{MAX_LENGTH}, got {text!r}")
    return lengths


def row_keys_of(text: str) -> list[int]:
    """"0,262144" -> [0, 262144]. Raises ValueError naming --row-keys."""
    try:
        caps = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--row-keys: {text!r} is not a comma list of integers") from None
    if not caps or any(c < 0 for c in caps):
        raise ValueError(f"--row-keys: each >= 0, got {text!r}")
    return caps


def profiled(call: Any) -> dict[str, Any]:
    """One call under torch.profiler: GPU busy ms (the union of kernel and copy intervals),
    kernels launched and torch ops dispatched."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
                 ) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    gpu = [(e.time_range.start, e.time_range.end) for e in events
           if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = covered(gpu)  # microseconds
    cpu_ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU
                  and e.name.startswith("aten::"))
    top = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:12]
    return {"gpu_busy_ms": busy / 1e3 if cuda else None, "kernels": len(gpu) if cuda else None,
            "cpu_ops": cpu_ops,
            "top_self_cpu": [{"name": a.key[:80], "calls": a.count,
                              "self_cpu_ms": a.self_cpu_time_total / 1e3} for a in top]}


def measure(llm: Any, vocab: int, length: int, repeats: int, rng: random.Random
            ) -> dict[str, Any]:
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)

    def call() -> None:  # a fresh prompt each time: nothing cached
        ids = [rng.randrange(10, vocab - 10) for _ in range(length)]
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)

    call()  # warm-up: this length's kernels compile
    walls = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        walls.append(1e3 * (time.perf_counter() - start))
    probes = [profiled(call) for _ in range(2)]
    wall = statistics.median(walls)
    busy = [p["gpu_busy_ms"] for p in probes]
    gpu_busy = None if busy[0] is None else statistics.median(busy)
    return {"length": length, "wall_ms": wall, "walls_ms": walls, "gpu_busy_ms": gpu_busy,
            "host_share": None if gpu_busy is None else max(0.0, 1 - gpu_busy / wall),
            "kernels": probes[-1]["kernels"], "cpu_ops": probes[-1]["cpu_ops"],
            "top_self_cpu": probes[-1]["top_self_cpu"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve import LLM

    lengths = lengths_of(args.lengths)
    # the model's length: the longest prompt and its one token, in whole blocks
    shape = dataclasses.replace(SHAPES[args.shape], max_positions=16 * (max(lengths) // 16 + 1))
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-prefill-step-") as folder:
        save_random_model(shape, Path(folder), args.seed, device)
        # max_num_seqs: the decode graphs' largest size, which bounds a prompt run as rows
        llm = LLM(folder, enable_prefix_caching=False, max_model_len=shape.max_positions,
                  max_num_batched_tokens=max(lengths), max_num_seqs=MAX_GRAPH_ROWS,
                  **({} if device.type == "cuda" else {"dtype": "float32",
                                                        "kv_cache_memory": 64 << 20}))
        rng = random.Random(args.seed)
        caps = [None] if args.row_keys is None else row_keys_of(args.row_keys)
        default = DecodeGraphs.row_keys_max
        try:
            for length in lengths:
                for cap in caps:
                    DecodeGraphs.row_keys_max = default if cap is None else cap
                    row = measure(llm, shape.vocab, length, args.repeats, rng)
                    rows.append({"row_keys_max": DecodeGraphs.row_keys_max, **row})
                    print(_line(rows[-1]), flush=True)
        finally:
            DecodeGraphs.row_keys_max = default
        llm.llm_engine.shutdown()
    report = {"config": config_of(args), "device": str(device),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
              "rows": rows}
    if args.output_json:
        write_report(report, args.output_json)
    return report


def _line(row: dict[str, Any]) -> str:
    gpu = "" if row["gpu_busy_ms"] is None else (
        f", GPU busy {row['gpu_busy_ms']:.2f} ms (host share {row['host_share']:.2f}), "
        f"{row['kernels']} kernels")
    return (f"{row['length']:6d} tokens (row keys <= {row['row_keys_max']}): "
            f"{row['wall_ms']:.2f} ms{gpu}, {row['cpu_ops']} torch ops")


def main(argv: list[str] | None = None) -> int:
    return bench_main("prefill_step", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
