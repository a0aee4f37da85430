"""The fused MoE layer on the GPU against a loop over experts and its bandwidth roofline.

    PYTHONPATH=. python -m pdserve.bench.gpu_moe --out DIR [--tokens 1,64,256] [--dry-run]

One MoE layer of a random Mixtral-shaped model (8 experts, top 2, hidden 2048, intermediate
7168, bf16; the model has 16 such layers, about 11 GiB of expert weights, so it fits one H100),
at each batch size in `--tokens`:

  fused     kernels/fused_moe.py: tokens sorted by expert, two grouped GEMMs, weighted sum
  loop      engine/models/moe.py's reference: one pass per expert that received tokens (the
            shape of transformers' loop; it syncs with the host once per layer)
  roofline  the bytes a layer must read, the touched experts' weights (3 * hidden *
            intermediate each) plus the activations in and out, at the measured device-to-device
            copy bandwidth (gpu_kernels.measure_ceilings)

Routing is a softmax over random router logits, top 2 renormalised (Mixtral's): at 1 token it
touches 2 experts, at 64 and more all 8. The report gives, per batch, the milliseconds of each
path, fused / roofline time (the fraction of the roofline reached; the issue's target is >= 0.6
at 256 tokens), loop / fused (the speedup) and the fused output's relative error against the
loop. JSON goes to DIR/bench_gpu_moe.json, rewritten after each batch size. `--dry-run` runs a
tiny shape on the CPU (the fused kernel through Triton's interpreter) to check the code. The tile
configs it uses come from pdserve/bench/gpu_moe_tune.py (kernels/fused_moe.py's TUNED table).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_kernels import SMALL_KERNELS, KernelSizes, measure_ceilings, rel_err, time_ms
from pdserve.bench.report import bench_main, config_of, write_report


@dataclass(frozen=True)
class MoEShape:
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 2048
    intermediate: int = 7168
    layers: int = 16  # the model's; one layer is timed (every layer is the same work)

    def expert_bytes(self, elem: int) -> int:
        """One expert's weights: gate and up [I, H], down [H, I]."""
        return 3 * self.hidden * self.intermediate * elem

    def model_expert_bytes(self, elem: int) -> int:
        return self.layers * self.num_experts * self.expert_bytes(elem)


SMALL_SHAPE = MoEShape(num_experts=4, top_k=2, hidden=32, intermediate=48, layers=2)
DEFAULT_TOKENS = (1, 64, 256)
SMALL_TOKENS = (1, 4, 16)


def layer_bytes(shape: MoEShape, touched: int, tokens: int, elem: int) -> int:
    """What one layer must move at least: each touched expert's weights once, x read and the
    output written once."""
    return touched * shape.expert_bytes(elem) + 2 * tokens * shape.hidden * elem


def roofline_ms(shape: MoEShape, touched: int, tokens: int, elem: int, bytes_per_s: float) -> float:
    return layer_bytes(shape, touched, tokens, elem) / bytes_per_s * 1e3


def random_routing(
    shape: MoEShape, tokens: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] fp32 weights, [T, K] int64 ids)
    from engine.models.moe import softmax_topk

    logits = torch.randn(tokens, shape.num_experts, generator=gen, device=device)
    return softmax_topk(logits, shape.top_k, renormalize=True)


def measure_layer(
    shape: MoEShape,
    tokens: int,
    weights: tuple[torch.Tensor, torch.Tensor],
    bytes_per_s: float,
    gen: torch.Generator,
) -> dict[str, Any]:
    """One batch size: fused and loop timings, the roofline and the ratios."""
    from engine.models.moe import moe_loop
    from kernels.fused_moe import fused_moe, tile_config

    w13, w2 = weights
    device, elem = w13.device, w13.element_size()
    x = (torch.randn(tokens, shape.hidden, generator=gen, device=device) * 0.5).to(w13.dtype)
    topk_weights, topk_ids = random_routing(shape, tokens, device, gen)
    touched = int(torch.unique(topk_ids).numel())
    fused = lambda: fused_moe(x, w13, w2, topk_weights, topk_ids)
    loop = lambda: moe_loop(x, w13, w2, topk_weights, topk_ids)
    fused_ms, loop_ms = time_ms(fused, device), time_ms(loop, device)
    roof_ms = roofline_ms(shape, touched, tokens, elem, bytes_per_s)
    return {
        "tokens": tokens,
        "touched_experts": touched,
        "tile_config": list(
            tile_config(
                tokens * shape.top_k,
                shape.num_experts,
                2 * shape.intermediate,
                shape.hidden,
                w13.dtype,
            )
        ),
        "bytes": layer_bytes(shape, touched, tokens, elem),
        "fused_ms": fused_ms,
        "loop_ms": loop_ms,
        "roofline_ms": roof_ms,
        "fused_roofline_fraction": roof_ms / fused_ms,
        "loop_over_fused": loop_ms / fused_ms,
        "rel_err": rel_err(fused(), loop()),
    }


def expert_weights(
    shape: MoEShape, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:  # w13 [E, 2I, H], w2 [E, H, I]
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=device) * i**-0.5).to(dtype)
    return w13, w2


def _tokens(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("--tokens is a comma list of positive integers")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of bench_gpu_moe.json")
    parser.add_argument(
        "--tokens",
        type=_tokens,
        default=None,
        help=f"batch sizes (default {','.join(map(str, DEFAULT_TOKENS))})",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="a tiny shape on the CPU, to check the code"
    )
    parser.add_argument("--device", default="auto", help="auto: cuda when there is one")
    parser.add_argument("--seed", type=int, default=0)


def plan(args: argparse.Namespace) -> tuple[MoEShape, tuple[int, ...], torch.device, torch.dtype]:
    """(shape, batch sizes, device, dtype) the arguments ask for; ValueError when the full run
    has no GPU."""
    auto = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    if args.dry_run:
        if device.type == "cpu":  # the kernel through Triton's interpreter; set before import
            os.environ.setdefault("TRITON_INTERPRET", "1")
        return SMALL_SHAPE, args.tokens or SMALL_TOKENS, device, torch.float32
    if device.type != "cuda":
        raise ValueError("the full benchmark needs a CUDA device (use --dry-run on a CPU)")
    return MoEShape(), args.tokens or DEFAULT_TOKENS, device, torch.bfloat16


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the copy bandwidth, then each batch size; write the JSON after each; print."""
    shape, token_counts, device, dtype = plan(args)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    start, path = time.perf_counter(), str(Path(args.out) / "bench_gpu_moe.json")
    sizes = SMALL_KERNELS if args.dry_run else dataclasses.replace(KernelSizes(), matmul_n=4096)
    ceilings = measure_ceilings(device, dtype, sizes)
    report: dict[str, Any] = {
        "config": config_of(args),
        "shape": dataclasses.asdict(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "model_expert_gib": shape.model_expert_bytes(torch.finfo(dtype).bits // 8) / 2**30,
        "ceilings": ceilings,
        "layers": [],
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    weights = expert_weights(shape, device, dtype, gen)
    for tokens in token_counts:
        report["layers"].append(
            measure_layer(shape, tokens, weights, ceilings["copy_bytes_per_s"], gen)
        )
        report["elapsed_s"] = time.perf_counter() - start
        write_report(report, path)
    print(format_table(report), flush=True)
    return report


def format_table(report: dict[str, Any]) -> str:
    s, c = report["shape"], report["ceilings"]
    lines = [
        f"fused MoE layer | {report.get('gpu', report['device'])} {report['dtype']} | "
        f"{s['num_experts']} experts top {s['top_k']}, hidden {s['hidden']}, intermediate "
        f"{s['intermediate']} | copy {c['copy_bytes_per_s'] / 1e12:.3f} TB/s",
        f"  {'tokens':>6}{'experts':>8}{'fused ms':>10}{'loop ms':>10}{'roof ms':>10}"
        f"{'roof/fused':>11}{'loop/fused':>11}{'rel err':>9}",
    ]
    for r in report["layers"]:
        lines.append(
            f"  {r['tokens']:>6}{r['touched_experts']:>8}{r['fused_ms']:>10.4f}"
            f"{r['loop_ms']:>10.4f}{r['roofline_ms']:>10.4f}{r['fused_roofline_fraction']:>11.2f}"
            f"{r['loop_over_fused']:>11.2f}{r['rel_err']:>9.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_moe", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
