"""Which dense projections take pdserve's Triton GEMV at decode sizes (CUDA): chosen once at load.

NOTE: batch-1 decode reads every weight once per token; cuBLAS's kernels for M <= 4 reach only
part of the copy bandwidth on some shapes (docs/benchmarks.md, batch-1 decode), and
kernels/gemv.py more on others. So, for each distinct weight shape among the model's dense
projections and the lm_head, and each padded token count M in (1, 2, 4):

    time F.linear and each candidate tile of kernels/gemv.py, each call over every layer's weight
    of that shape in turn (the weights stream from DRAM, not L2), replayed from a CUDA graph as
    decode steps are; keep the GEMV's best tile if it is at least MARGIN faster, else cuBLAS.

Two fusions are timed the same way against the unfused kernels as just chosen: SwiGLU in the down
projection's prologue (kernels/gemv_silu.py, against silu_and_mul + down) and the residual add
+ RMSNorm in the prologue of the projection after the norm (kernels/gemv_rmsnorm.py: q/k/v
after input_layernorm, gate_up after post_attention_layernorm; against rms_norm + projection;
M = 1 only). Each fused kernel removes one launch per layer, a few microseconds in a graph.
The choices ride on the weight parameters (`weight.gemv_plan`, `weight.gemv_silu_plan`,
`weight.gemv_norm_plan`: `GemvPlan`), which engine/models/tp_layers.py's `dense_linear`,
`silu_mul_linear` and `rmsnorm_linear` read; M = 3 takes M = 4's choice. Runs before the CUDA
graphs are captured (they capture whatever was chosen); the timing takes a few seconds, mostly
Triton compiles. Timings move by a few percent between loads, so two loads could choose
differently where candidates are close (outputs then differ by bf16 rounding): the choices are
recorded per host (`EngineConfig.decode_gemv_cache`, engine/models/gemv_plan_store.py) and every
later process on the same GPU model takes them untimed.
`EngineConfig.decode_gemv=False` skips it: cuBLAS and separate kernels everywhere, as before.
What is timed for each shape: engine/models/gemv_calls.py; how: engine/cuda_timing.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.cuda_timing import graph_us
from engine.models.gemv_calls import Calls, gated_calls, linear_calls, norm_calls, silu_calls
from engine.models.gemv_plan_store import PlanStore, plan_key
from engine.models.tp_layers import (
    Linear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gemv_act_dtype,
    gemv_scale,
    gemv_weight,
)
from kernels.gemv import GEMV_MAX_TOKENS, GemvBlocks

logger = logging.getLogger(__name__)

TOKENS = (1, 2, 4)  # the padded token counts of decode graphs up to GEMV_MAX_TOKENS
MARGIN = 0.97  # the GEMV must take at most this fraction of cuBLAS's time
# candidate tiles per padded M (pdserve/bench/gpu_decode_profile.py sweeps more). H100,
# 2026-11-24: at M = 1 the best were 2-4 rows x 1024 (1.1-1.2x cuBLAS at N <= 3072 and the
# lm_head, on par at gate_up / down); at M = 2 and 4 cuBLAS won every shape. `pdl` variants:
# programmatic dependent launch (kernels/gemv.py `launch_options`), where Triton has it.
CANDIDATES: dict[int, tuple[GemvBlocks, ...]] = {
    1: (GemvBlocks(2, 1024, 4), GemvBlocks(4, 1024, 4), GemvBlocks(2, 2048, 4),
        GemvBlocks(2, 1024, 4, pdl=True), GemvBlocks(4, 1024, 4, pdl=True)),
    2: (GemvBlocks(4, 512, 4),),
    4: (GemvBlocks(4, 256, 4),),
}
SILU_CANDIDATES: dict[int, tuple[GemvBlocks, ...]] = {
    1: (GemvBlocks(4, 2048, 8), GemvBlocks(8, 1024, 8), GemvBlocks(4, 2048, 8, pdl=True)),
}
# (BLOCK_N, warps, pdl) of the fused norm kernels (the tile spans K; M = 1 only)
NORM_ROWS = ((4, 4, False), (4, 8, False), (8, 8, False), (4, 4, True), (4, 8, True))
GATED_ROWS = ((1, 4, False), (2, 8, False), (1, 4, True), (2, 8, True))  # two tiles each
# (BLOCK_N, BLOCK_K, warps, pdl): the fused gate_up's K-loop kernel (kernels/fp8_gemv.py's shape)
GATED_KLOOP = ((4, 512, 4, True), (8, 256, 4, True))
# one token row per program, [BLOCK_N, BLOCK_K] steps (kernels/gemv_kloop.py): the shape of the
# fused gate_up's K loop, which streamed FP8 rows at 2.66 TB/s on an H200 (docs/benchmarks.md)
KLOOP_CANDIDATES = tuple(GemvBlocks(bn, bk, 4, True, True)
                         for bn, bk in ((4, 512), (8, 256), (8, 512), (16, 256)))
# K = 8192 (the down projection, 2048 rows): its best above, 4 x 2048 x 4, streamed 2.24 TB/s on
# an H200 with 512 programs of four rows; fewer, longer programs (K a multiple of BLOCK_K only)
LONG_K_CANDIDATES = (GemvBlocks(2, 4096, 4, pdl=True), GemvBlocks(4, 4096, 8, pdl=True),
                     GemvBlocks(8, 2048, 8, pdl=True))
# FP8 codes (engine/quant/fp8.py): a row is half a bf16 row's bytes, so tiles twice as long
# along K or twice as many rows keep as many bytes in flight; timed besides the ones above.
FP8_CANDIDATES: dict[str, dict[int, tuple]] = {
    "linear": {1: (GemvBlocks(4, 2048, 4), GemvBlocks(8, 1024, 4),
                   GemvBlocks(4, 2048, 4, pdl=True), GemvBlocks(8, 1024, 4, pdl=True),
                   *KLOOP_CANDIDATES, *LONG_K_CANDIDATES),
               2: (GemvBlocks(4, 1024, 4),), 4: (GemvBlocks(4, 512, 4),)},
    "silu+down": {1: (GemvBlocks(8, 2048, 8), GemvBlocks(4, 4096, 8),
                      GemvBlocks(8, 2048, 8, pdl=True))},
    "norm+linear": {1: ((8, 8, True), (16, 8, False))},
    "norm+gate_up+silu": {1: ((4, 8, False), (4, 8, True), (8, 256, 4, False),
                              (8, 256, 4, True), (16, 256, 4, True), (8, 512, 4, True),
                              (16, 512, 4, True), (32, 256, 4, True), (16, 256, 8, True))},
}


@dataclass(frozen=True)
class GemvPlan:
    """Per padded token count (1, 2, 4): the GEMV's tile, or None for the fallback."""

    by_tokens: tuple[tuple[int, GemvBlocks | None], ...]

    def blocks_for(self, tokens: int) -> GemvBlocks | None:
        for padded, blocks in self.by_tokens:
            if tokens <= padded:
                return blocks
        return None

    @property
    def used(self) -> bool:
        return any(b is not None for _, b in self.by_tokens)


def plan_decode_gemv(model: nn.Module, store: PlanStore | None = None) -> dict[str, dict]:
    """Time and attach the plans (see the NOTE) to `model`'s dense projections on CUDA; returns
    the timings, per shape, also kept as `model.decode_gemv_report` (benchmarks read it). Side
    effect: sets `weight.gemv_plan` / `gemv_silu_plan` / `gemv_norm_plan` where it timed them.
    With `store`, a shape another process planned on this GPU model takes its recorded choice
    untimed, and new choices are recorded (engine/models/gemv_plan_store.py)."""
    start = time.perf_counter()
    report: dict[str, dict] = {}
    with torch.inference_mode(), (
            contextlib.nullcontext({}) if store is None else store.locked()) as known:
        def plan(what: str, n: int, k: int, items: list, calls: Calls,
                 candidates: dict[int, tuple[GemvBlocks, ...]]) -> GemvPlan:
            w = items[0][0] if isinstance(items[0], tuple) else items[0]
            if gemv_scale(w) is not None:
                candidates = _with_fp8_tiles(what, k, candidates)
            key = plan_key(what, n, k, str(w.dtype).removeprefix("torch."),
                           _device_name(w.device), _versions())
            if key in known:
                chosen = GemvPlan(tuple((m, None if c is None else GemvBlocks(*c))
                                        for m, c in sorted(known[key].items())))
                report[f"{what} {n}x{k}"] = {"us": {}, "recorded": True,
                                             "choice": dict(sorted(known[key].items()))}
                return chosen
            chosen, report[f"{what} {n}x{k}"] = _choose(items, calls, candidates)
            known[key] = {m: None if b is None else tuple(b) for m, b in chosen.by_tokens}
            return chosen

        for (n, k), weights in _dense_weights(model).items():
            chosen = plan("linear", n, k, weights, linear_calls, CANDIDATES)
            for w in weights:
                w.gemv_plan = chosen
        for (n, k), weights in _down_weights(model).items():
            chosen = plan("silu+down", n, k, weights, silu_calls, SILU_CANDIDATES)
            for w in weights:
                w.gemv_silu_plan = chosen
        for (n, k), pairs in _normed_weights(model).items():
            tiles = {1: tuple(GemvBlocks(bn, k, warps, pdl) for bn, warps, pdl in NORM_ROWS)}
            chosen = plan("norm+linear", n, k, pairs, norm_calls, tiles)
            for w, _ in pairs:
                w.gemv_norm_plan = chosen
        for (n, k), pairs in _gated_weights(model).items():
            tiles = {1: tuple(GemvBlocks(bn, k, warps, pdl) for bn, warps, pdl in GATED_ROWS)
                     + tuple(b for t in GATED_KLOOP if (b := _norm_tile(t, k)) is not None)}
            chosen = plan("norm+gate_up+silu", n, k, pairs, gated_calls, tiles)
            for w, _ in pairs:
                w.gemv_norm_silu_plan = chosen
    model.decode_gemv_report = report
    torch.cuda.empty_cache()  # the timing's graphs and buffers: before the KV cache is sized
    logger.info("decode GEMV plan in %.1f s: %s", time.perf_counter() - start,
                {name: r["choice"] for name, r in report.items()})
    return report


def _with_fp8_tiles(what: str, k: int, candidates: dict[int, tuple[GemvBlocks, ...]]
                    ) -> dict[int, tuple[GemvBlocks, ...]]:
    """`candidates` and FP8_CANDIDATES[what] (norm kernels: (rows, warps, pdl) spanning K, or
    a K-loop tile of four, kept where its BLOCK_K is shorter than K)."""
    norm = what.startswith("norm")
    more = {m: tuple(b for t in tiles if (b := _norm_tile(t, k) if norm else t) is not None)
            for m, tiles in FP8_CANDIDATES.get(what, {}).items()}
    return {m: candidates.get(m, ()) + more.get(m, ()) for m in {*candidates, *more}}


def _norm_tile(t: tuple, k: int) -> GemvBlocks | None:
    """A fused norm kernel's candidate: (rows, warps, pdl) spanning K, or a K-loop tile
    (rows, BLOCK_K, warps, pdl), None where its BLOCK_K is not shorter than K."""
    if len(t) == 4:
        return GemvBlocks(*t) if t[1] < k else None
    return GemvBlocks(t[0], k, t[1], t[2])


def clear_decode_gemv(model: nn.Module) -> None:
    """Drop every plan: cuBLAS (and the separate SiLU kernel) everywhere again."""
    weights = [gemv_weight(m) for m in model.modules()]
    for p in [*model.parameters(), *(w for w in weights if w is not None)]:
        p.__dict__.pop("gemv_plan", None)
        p.__dict__.pop("gemv_silu_plan", None)
        p.__dict__.pop("gemv_norm_plan", None)
        p.__dict__.pop("gemv_norm_silu_plan", None)


def _dense_weights(model: nn.Module) -> dict[tuple[int, int], list[nn.Parameter]]:
    """Weights of projections (and the vocab head) by shape, on CUDA, 16-bit or fp32, or an FP8
    layer's codes (engine/models/tp_layers.py `gemv_weight`)."""
    groups: dict[tuple[int, int], list[nn.Parameter]] = {}
    head = _head(model)
    for module in model.modules():
        w = head.weight if module is head else gemv_weight(module)
        if w is not None and _plannable(w):
            groups.setdefault(tuple(w.shape), []).append(w)
    return groups


def _plannable(w: torch.Tensor) -> bool:
    return w.is_cuda and w.dim() == 2 and (w.dtype in _DTYPES or gemv_scale(w) is not None)


def _down_weights(model: nn.Module) -> dict[tuple[int, int], list[nn.Parameter]]:
    """Bias-free down projections of SwiGLU MLPs (a `gate_up_proj` beside a `down_proj`)."""
    groups: dict[tuple[int, int], list[nn.Parameter]] = {}
    for module in model.modules():
        down = getattr(module, "down_proj", None)
        w = None if isinstance(down, Linear) else gemv_weight(down)
        if (w is not None and hasattr(module, "gate_up_proj") and down.bias is None
                and _plannable(w)):
            groups.setdefault(tuple(w.shape), []).append(w)
    return groups


def _normed_weights(model: nn.Module) -> dict[tuple[int, int], list[tuple[nn.Parameter, Any]]]:
    """(projection weight, the RMSNorm before it) of every decoder layer: q/k/v after
    input_layernorm, and gate_up after post_attention_layernorm."""
    groups: dict[tuple[int, int], list[tuple[nn.Parameter, Any]]] = {}
    for layer in model.modules():
        for norm_name, sub, proj_name in (("input_layernorm", "self_attn", "qkv_proj"),
                                          ("post_attention_layernorm", "mlp", "gate_up_proj")):
            norm = getattr(layer, norm_name, None)
            proj = getattr(getattr(layer, sub, None), proj_name, None)
            w = None if isinstance(proj, RowParallelLinear) else gemv_weight(proj)
            if norm is None or w is None or not _plannable(w):
                continue
            if norm.weight.dtype == gemv_act_dtype(w):
                groups.setdefault(tuple(w.shape), []).append((w, norm))
    return groups


def _gated_weights(model: nn.Module) -> dict[tuple[int, int], list[tuple[nn.Parameter, Any]]]:
    """(gate_up weight, post_attention_layernorm) of SwiGLU MLPs with bias-free gate_up."""
    gate_ups = {id(gemv_weight(m.gate_up_proj)) for m in model.modules()
                if gemv_weight(getattr(m, "gate_up_proj", None)) is not None
                and m.gate_up_proj.bias is None and hasattr(m, "down_proj")}
    groups: dict[tuple[int, int], list[tuple[nn.Parameter, Any]]] = {}
    for shape, pairs in _normed_weights(model).items():
        for w, norm in pairs:
            if id(w) in gate_ups:
                groups.setdefault(shape, []).append((w, norm))
    return groups


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _device_name(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


def _versions() -> str:
    import triton

    return f"torch {torch.__version__} triton {triton.__version__}"


def _head(model: nn.Module) -> nn.Module | None:
    """The module whose weight the logits read: the lm_head, or the tied embedding."""
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(getattr(model, "model", None), "embed_tokens", None)
    return head if isinstance(head, VocabParallelEmbedding) else None


def _choose(weights: list, calls: Calls, candidates: dict[int, tuple[GemvBlocks, ...]]
            ) -> tuple[GemvPlan, dict]:
    """The plan for one shape: per padded token count in `candidates`, the fastest candidate
    tile if it beats the fallback (`blocks` None) by MARGIN."""
    choices, times = [], {}
    for m in TOKENS:
        if m not in candidates:
            continue
        base = graph_us(calls(weights, m, None))
        best, best_us = None, base
        for blocks in candidates[m]:
            fns = calls(weights, m, blocks)
            if not fns:
                continue
            try:
                us = graph_us(fns)
            except Exception as exc:  # e.g. a Triton without programmatic dependent launch
                logger.warning("decode GEMV candidate %s failed: %s", blocks, exc)
                times[f"M{m} {tuple(blocks)}"] = f"failed: {type(exc).__name__}"
                continue
            times[f"M{m} {tuple(blocks)}"] = us
            if us < best_us * (MARGIN if best is None else 1.0):
                best, best_us = blocks, us
        times[f"M{m} fallback"] = base
        choices.append((m, best))
    plan = GemvPlan(tuple(choices))
    return plan, {"us": times, "choice": {m: None if b is None else tuple(b) for m, b in choices}}


__all__ = ["GEMV_MAX_TOKENS", "GemvPlan", "clear_decode_gemv", "plan_decode_gemv"]
