"""Tile configs for the fused MoE GEMMs on this GPU, and where one fused layer's time goes.

    PYTHONPATH=. python -m pdserve.bench.gpu_moe_tune --out DIR [--tokens 1,64,256]

For gpu_moe's Mixtral-shaped layer (bf16) at each batch size: every candidate (BLOCK_M, BLOCK_N,
BLOCK_K, GROUP_M, num_warps, num_stages) of the gate_up GEMM and of the down GEMM, each GEMM
timed alone on the aligned pairs (triton's do_bench: L2 flushed, median); the best BLOCK_M is
the one whose best pair of configs is fastest (both GEMMs share the alignment). Then the pieces
of `fused_moe` with the chosen configs, each timed alone on the GPU, the host's time to issue
one call, and the whole call eagerly and replayed from a CUDA graph. The lines to paste into
kernels/fused_moe.py's TUNED table are printed; JSON goes to DIR/bench_gpu_moe_tune.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_kernels import time_ms
from pdserve.bench.gpu_moe import (
    DEFAULT_TOKENS,
    MoEShape,
    _tokens,
    expert_weights,
    random_routing,
)
from pdserve.bench.report import bench_main, config_of, write_report


def candidates(block_m: int) -> list[tuple[int, ...]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) to try at one BLOCK_M."""
    found = [
        (block_m, n, k, 8, 4, stages)
        for n, k, stages in itertools.product((32, 64, 128), (64, 128), (3, 4))
    ]
    if block_m >= 64:
        found += [(block_m, 128, 64, 8, 8, 3), (block_m, 128, 128, 8, 8, 3)]
    return found


def block_ms(tokens: int, top_k: int, experts: int) -> tuple[int, ...]:
    per_expert = tokens * top_k / experts
    return (16,) if per_expert <= 4 else (16, 32) if per_expert <= 24 else (32, 64)


def tune_tokens(shape: MoEShape, tokens: int, weights, gen) -> dict[str, Any]:
    """Each GEMM's candidates at each BLOCK_M; the best pair."""
    from kernels.fused_moe import _grouped_gemm
    from kernels.moe_align import moe_align

    w13, w2 = weights
    x = (torch.randn(tokens, shape.hidden, generator=gen, device=w13.device) * 0.5).to(w13.dtype)
    topk_weights, topk_ids = random_routing(shape, tokens, w13.device, gen)
    pairs, two_i = topk_ids.numel(), 2 * shape.intermediate
    gate_up = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    act = torch.randn(pairs, shape.intermediate, generator=gen, device=x.device).to(x.dtype)
    down = torch.zeros(pairs, shape.hidden, dtype=x.dtype, device=x.device)
    rows, best = [], None
    for bm in block_ms(tokens, shape.top_k, shape.num_experts):
        aligned = moe_align(topk_ids, shape.num_experts, bm)
        up = _time_configs(_grouped_gemm, (x, w13, gate_up, None, aligned, pairs, shape.top_k),
                           candidates(bm))
        dn = _time_configs(_grouped_gemm, (act, w2, down, topk_weights, aligned, pairs, 1),
                           candidates(bm))
        rows += [{"gemm": "up", "ms": t, "config": c} for t, c in up]
        rows += [{"gemm": "down", "ms": t, "config": c} for t, c in dn]
        pair = (min(up)[0] + min(dn)[0], min(up), min(dn))
        best = pair if best is None or pair[0] < best[0] else best
        print(f"tokens {tokens} BLOCK_M {bm}: up {min(up)} down {min(dn)}", flush=True)
    assert best is not None
    return {"tokens": tokens, "best_ms": best[0], "up": best[1], "down": best[2], "all": rows}


def _time_configs(gemm, args: tuple, configs: list) -> list[tuple[float, tuple[int, ...]]]:
    """(ms, config) of each config; inf for one that does not compile here (shared memory)."""
    timed = []
    for c in configs:
        try:
            timed.append((time_ms(lambda c=c: gemm(*args, c), args[0].device), c))
        except Exception as exc:  # noqa: BLE001 (triton's OutOfResources and kin)
            print(f"config {c}: {type(exc).__name__}: {exc}", flush=True)
            timed.append((float("inf"), c))
    return timed


def pieces(shape: MoEShape, tokens: int, weights, gen) -> dict[str, float]:
    """fused_moe's pieces alone on the GPU, the host's issue time, eager and graphed calls."""
    import kernels.fused_moe as fm
    from kernels.moe_align import moe_align, moe_align_ref
    from kernels.silu_mul import silu_and_mul

    w13, w2 = weights
    dev = w13.device
    x = (torch.randn(tokens, shape.hidden, generator=gen, device=dev) * 0.5).to(w13.dtype)
    topk_weights, topk_ids = random_routing(shape, tokens, dev, gen)
    pairs, two_i = topk_ids.numel(), 2 * shape.intermediate
    up_cfg = fm.tile_config(pairs, shape.num_experts, two_i, shape.hidden, x.dtype)
    dn_cfg = fm.tile_config(pairs, shape.num_experts, shape.hidden, shape.intermediate, x.dtype)
    dn_cfg = (up_cfg[0], *dn_cfg[1:])
    aligned = moe_align(topk_ids, shape.num_experts, up_cfg[0])
    gate_up = torch.empty(pairs, two_i, dtype=x.dtype, device=dev)
    act = silu_and_mul(gate_up)
    down = torch.zeros(pairs, shape.hidden, dtype=x.dtype, device=dev)
    call = lambda: fm.fused_moe(x, w13, w2, topk_weights, topk_ids)  # noqa: E731
    out = {
        "align_kernel_ms": time_ms(lambda: moe_align(topk_ids, shape.num_experts, 16), dev),
        "align_torch_ref_ms": time_ms(
            lambda: moe_align_ref(topk_ids, shape.num_experts, 16), dev),
        "gemm_up_ms": time_ms(lambda: fm._grouped_gemm(
            x, w13, gate_up, None, aligned, pairs, shape.top_k, up_cfg), dev),
        "silu_mul_ms": time_ms(lambda: silu_and_mul(gate_up), dev),
        "zeros_ms": time_ms(lambda: torch.zeros_like(down), dev),
        "gemm_down_ms": time_ms(lambda: fm._grouped_gemm(
            act, w2, down, topk_weights, aligned, pairs, 1, dn_cfg), dev),
        "sum_ms": time_ms(lambda: down.view(tokens, shape.top_k, -1).sum(dim=1), dev),
        "eager_ms": time_ms(call, dev),
        "host_issue_ms": host_issue_ms(call),
    }
    graph = torch.cuda.CUDAGraph()
    call()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        call()
    out["graph_replay_ms"] = time_ms(graph.replay, dev)
    return out


def host_issue_ms(call, reps: int = 200) -> float:
    """The host's milliseconds to issue one call (queued, not waited for)."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / reps * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise ValueError("the tuner needs a CUDA device")
    shape, dev = MoEShape(), torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    weights = expert_weights(shape, dev, torch.bfloat16, gen)
    report: dict[str, Any] = {"config": config_of(args), "gpu": torch.cuda.get_device_name(dev),
                              "pieces": {}, "tuned": []}
    path = str(Path(args.out) / "bench_gpu_moe_tune.json")
    for tokens in args.tokens or DEFAULT_TOKENS:
        report["pieces"][str(tokens)] = pieces(shape, tokens, weights, gen)
        print(f"tokens {tokens} pieces {report['pieces'][str(tokens)]}", flush=True)
        write_report(report, path)
    if not args.pieces_only:
        for tokens in args.tokens or DEFAULT_TOKENS:
            report["tuned"].append(tune_tokens(shape, tokens, weights, gen))
            write_report(report, path)
    for t in report["tuned"]:
        print(f"tokens {t['tokens']}: {t['best_ms']:.4f} ms up {t['up']} down {t['down']}")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of the JSON")
    parser.add_argument("--tokens", type=_tokens, default=None, help="batch sizes")
    parser.add_argument("--pieces-only", action="store_true", help="skip the config sweep")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_moe_tune", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
