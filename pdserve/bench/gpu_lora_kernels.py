"""Batched multi-LoRA (kernels/lora.py) per projection against its reference and the base GEMM.

    PYTHONPATH=. python -m pdserve.bench.gpu_lora_kernels [--tokens 1,8,64] [--tune] [--dry-run]

A 1B Llama's projections (hidden 2048, q 2048, kv 512, intermediate 8192; bf16), rank 16 and
4 adapter slots, at each token count T: qkv (3 slices, GQA), o, gate_up (2 slices), down.
Slots are spread evenly: interleaved (t % 4, every neighbour a different adapter: decode) up to
256 tokens, contiguous runs of T / 4 above (4 prompts: prefill). One JSON line per row:

  lora_ms   lora_apply with choose_config's tiles, timed inside a CUDA graph (the engine
            captures its decode steps): a graph of calls over enough copies of the adapter
            weights to overflow L2 (as the weights of the other layers would), replayed;
            the median replay over the calls
  ref_ms    lora_apply_ref (torch, one host sync), CUDA events around eager calls
  base_ms   the projection itself, F.linear with a bf16 weight, timed like lora_ms
  lora/base the LoRA overhead on the projection; ref/lora the speedup over torch
  rel_err   ||delta_kernel - delta_ref|| / ||delta_ref|| in fp32

`--tune` instead sweeps tiles per row (for each slot grouping: the shrink, then the expand)
and prints the best; the results feed kernels/lora.py's choose_config. `--dry-run` runs a tiny
shape on the CPU (with TRITON_INTERPRET=1 the kernels through Triton's interpreter; host
timers) to check the code.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.cuda_timing import graph_us
from kernels.lora import (
    FUSED_MAX_T,
    FusedConfig,
    LoRAConfig,
    choose_config,
    lora_apply,
    lora_apply_ref,
)
from pdserve.bench.report import bench_main

L2_BYTES = 50 << 20  # an H100's L2; the graph's weight copies add up to twice this


@dataclass(frozen=True)
class LoRAShape:
    hidden: int = 2048
    q: int = 2048
    kv: int = 512
    intermediate: int = 8192
    rank: int = 16
    slots: int = 4

    def modules(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Projection -> (in features, slice_offsets of its output)."""
        q, kv, inter = self.q, self.kv, self.intermediate
        return {
            "qkv": (self.hidden, (0, q, q + kv, q + 2 * kv)),
            "o": (q, (0, self.hidden)),
            "gate_up": (self.hidden, (0, inter, 2 * inter)),
            "down": (inter, (0, self.hidden)),
        }


SMALL_SHAPE = LoRAShape(hidden=64, q=64, kv=16, intermediate=96, rank=8, slots=3)
DEFAULT_TOKENS = (1, 8, 64, 256, 2048)
INTERLEAVED_UP_TO = 256


def spread_slots(tokens: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """Interleaved (decode) up to INTERLEAVED_UP_TO tokens, else contiguous runs (prefill)."""
    t = torch.arange(tokens, device=device)
    spread = t % num_slots if tokens <= INTERLEAVED_UP_TO else t * num_slots // tokens
    return spread.to(torch.int32)


@dataclass
class Problem:
    """One projection's tensors at one T; `a`, `b`, `w` hold copies of the weights."""

    x: torch.Tensor  # [T, in]
    a: list[torch.Tensor]  # [S, n_slices * R, in] each
    b: list[torch.Tensor]  # [S, N, R] each
    w: list[torch.Tensor]  # [N, in] each: the base weight
    slots: torch.Tensor  # [T] int32
    y: torch.Tensor  # [T, N]
    offsets: tuple[int, ...]


def make_problem(shape: LoRAShape, module: str, tokens: int, device: torch.device,
                 dtype: torch.dtype) -> Problem:
    k, offsets = shape.modules()[module]
    n, n_slices, r, s = offsets[-1], len(offsets) - 1, shape.rank, shape.slots
    lora_bytes = (s * n_slices * r * k + s * n * r) * dtype.itemsize
    lora_copies = 1 if device.type != "cuda" else min(64, max(2, 2 * L2_BYTES // lora_bytes))
    base_copies = 1 if device.type != "cuda" else min(16, max(2, 2 * L2_BYTES // (n * k * 2)))
    return Problem(
        x=torch.randn(tokens, k, device=device, dtype=dtype),
        a=[torch.randn(s, n_slices * r, k, device=device, dtype=dtype) * k**-0.5
           for _ in range(lora_copies)],
        b=[torch.randn(s, n, r, device=device, dtype=dtype) * r**-0.5 * 0.5
           for _ in range(lora_copies)],
        w=[torch.randn(n, k, device=device, dtype=dtype) * k**-0.5 for _ in range(base_copies)],
        slots=spread_slots(tokens, s, device),
        y=torch.zeros(tokens, n, device=device, dtype=dtype),
        offsets=offsets,
    )


# ---- timing ------------------------------------------------------------------------------------
def graph_ms(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Milliseconds per call: the calls captured back to back in one CUDA graph, median of
    `replays` single replays (on the CPU: host time of the calls, run twice)."""
    if torch.cuda.is_available():
        return graph_us(calls, replays=1, rounds=replays) / 1e3
    for call in calls:  # compiles, as on the GPU
        call()
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e3 / len(calls)


def eager_ms(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def lora_ms(p: Problem, config: LoRAConfig | FusedConfig | None = None) -> float:
    return graph_ms([
        (lambda a=a, b=b: lora_apply(p.x, a, b, p.slots, p.y, p.offsets, config=config))
        for a, b in zip(p.a, p.b)
    ])


def base_ms(p: Problem) -> float:
    return graph_ms([(lambda w=w: F.linear(p.x, w)) for w in p.w])


def rel_err(p: Problem) -> float:
    ours, ref = torch.zeros_like(p.y), torch.zeros_like(p.y)
    lora_apply(p.x, p.a[0], p.b[0], p.slots, ours, p.offsets)
    lora_apply_ref(p.x, p.a[0], p.b[0], p.slots, ref, p.offsets)
    return ((ours.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


# ---- the two modes -----------------------------------------------------------------------------
def measure_row(p: Problem, module: str) -> dict[str, Any]:
    tokens = p.x.shape[0]
    config = choose_config(tokens, p.x.shape[1], p.y.shape[1])
    shown = (list(vars(config).values()) if isinstance(config, FusedConfig) else
             [config.shrink, config.expand, "by_slot" if config.by_slot else "walk"])
    ours = lora_ms(p)
    ref = eager_ms(lambda: lora_apply_ref(p.x, p.a[0], p.b[0], p.slots, p.y, p.offsets))
    base = base_ms(p)
    return {
        "module": module, "tokens": tokens,
        "config": ["fused", *shown] if isinstance(config, FusedConfig) else shown,
        "lora_ms": round(ours, 5), "ref_ms": round(ref, 5), "base_ms": round(base, 5),
        "lora/base": round(ours / base, 3), "ref/lora": round(ref / ours, 1),
        "rel_err": float(f"{rel_err(p):.2e}"),
    }


def tune_fused(p: Problem) -> list[Any]:
    """The fastest one-launch tiles: [ms, block_m, block_n, block_k, split_k, by_slot, warps,
    stages]."""
    tokens, k = p.x.shape
    configs = [FusedConfig(bm, bn, 256, split, by_slot)
               for bm in (16, 64) if bm <= max(16, tokens) for bn in (64, 128, 256)
               for split in (1, 2, 4, 8) if split == 1 or k // split >= 256
               for by_slot in (False, True)]
    ms, best = min((lora_ms(p, c), i) for i, c in enumerate(configs))
    return [round(ms, 5), *vars(configs[best]).values()]


def tune_row(p: Problem, module: str) -> dict[str, Any]:
    """The best one-launch tiles (up to 16 tokens); then per slot grouping (a
    grid axis per slot, or one program walking its tile's slots), the best shrink tiles under
    a default expand, then the best expand tiles under that shrink."""
    tokens, k = p.x.shape
    row: dict[str, Any] = {"module": module, "tokens": tokens,
                           "default_ms": round(lora_ms(p), 5)}
    if tokens <= 16:
        row["fused"] = tune_fused(p)
    bms = (16, 64) if tokens <= 64 else (32, 64, 128)
    for by_slot in (False, True):
        default = choose_config(max(tokens, FUSED_MAX_T + 1), k, p.y.shape[1])
        shrinks = [(bm, bk, split, 4, 3) for bm in bms for bk in (64, 128)
                   for split in (1, 2, 4, 8, 16, 32) if k // split >= 2 * bk or split == 1]
        shrink = min((lora_ms(p, LoRAConfig(s, default.expand, by_slot)), s) for s in shrinks)[1]
        expands = [(bm, bn, cb, 4, 3) for bm in bms for bn in (64, 128) for cb in (1, 2)]
        ms, expand = min((lora_ms(p, LoRAConfig(shrink, e, by_slot)), e) for e in expands)
        row["by_slot" if by_slot else "walk"] = [round(ms, 5), shrink, expand]
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=lambda s: tuple(int(t) for t in s.split(",")),
                        default=None, help=f"token counts (default {DEFAULT_TOKENS})")
    parser.add_argument("--modules", default="qkv,o,gate_up,down")
    parser.add_argument("--tune", action="store_true", help="sweep tiles instead")
    parser.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not args.dry_run and not torch.cuda.is_available():
        raise ValueError("no GPU: use --dry-run (tiny shape, Triton's interpreter)")
    shape = SMALL_SHAPE if args.dry_run else LoRAShape()
    tokens = args.tokens or ((1, 5, 20) if args.dry_run else DEFAULT_TOKENS)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    rows = []
    for t in tokens:
        for module in args.modules.split(","):
            problem = make_problem(shape, module, t, device, dtype)
            rows.append((tune_row if args.tune else measure_row)(problem, module))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_lora_kernels", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
