"""What the decode GEMV plan (engine/models/gemv_plan.py) times for one weight shape: the calls
one decode step would make over every layer's weight of that shape, at a padded token count M,
through a candidate tile of a GEMV kernel, or (`blocks` None) through what runs without it.

    linear_calls  F.linear, or kernels/gemv.py
    silu_calls    silu_and_mul + the down projection as planned, or kernels/gemv_silu.py
    norm_calls    rms_norm + the projection as planned, or kernels/gemv_rmsnorm.py
    gated_calls   rms_norm + gate_up as planned + silu_and_mul, or kernels/gemv_rmsnorm_swiglu.py

Each returns the calls (inputs random, made once), or [] where the kernel cannot take the shape.
A weight may be an FP8 layer's codes (`gemv_scale` on it: engine/models/tp_layers.py): the
activations then have the layer's dtype (`gemv_act_dtype`), the kernels take the row scales, and
what runs without the GEMV is kernels/fp8_gemv.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.tp_layers import dense_linear, gemv_act_dtype, gemv_scale
from kernels.fp8_gemv import fp8_gemv
from kernels.gemv import GemvBlocks, gemv, gemv_supports
from kernels.gemv_rmsnorm import gemv_rmsnorm, gemv_rmsnorm_supports
from kernels.gemv_rmsnorm_swiglu import gemv_rmsnorm_swiglu, gemv_rmsnorm_swiglu_supports
from kernels.gemv_silu import gemv_silu, gemv_silu_supports
from kernels.rmsnorm import rms_norm
from kernels.silu_mul import silu_and_mul

Calls = Callable[[list, int, GemvBlocks | None], list[Callable[[], object]]]


def _randn(m: int, k: int, w: torch.Tensor) -> torch.Tensor:
    """[m, k] activations for weight `w`: its dtype, or an FP8 layer's activation dtype."""
    return torch.randn(m, k, device=w.device, dtype=gemv_act_dtype(w))


def _unplanned(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a projection runs without a GEMV plan: F.linear, or an FP8 weight's own GEMV."""
    scale = gemv_scale(w)
    return F.linear(x, w) if scale is None else fp8_gemv(x, w, scale)


def linear_calls(weights: list[nn.Parameter], m: int, blocks: GemvBlocks | None
                 ) -> list[Callable[[], object]]:
    w0 = weights[0]
    x = _randn(m, w0.shape[1], w0)
    if blocks is None:
        return [lambda w=w: _unplanned(x, w) for w in weights]
    if not gemv_supports(x, w0, blocks, gemv_scale(w0)):
        return []
    return [lambda w=w: gemv(x, w, None, blocks, gemv_scale(w)) for w in weights]


def silu_calls(weights: list[nn.Parameter], m: int, blocks: GemvBlocks | None
               ) -> list[Callable[[], object]]:
    w0 = weights[0]
    gate_up = _randn(m, 2 * w0.shape[1], w0)
    if blocks is None:  # what the MLP runs without the fusion: its down projection as planned
        return [lambda w=w: dense_linear(silu_and_mul(gate_up), w) for w in weights]
    if not gemv_silu_supports(gate_up, w0, blocks, gemv_scale(w0)):
        return []
    return [lambda w=w: gemv_silu(gate_up, w, blocks, gemv_scale(w)) for w in weights]


def norm_calls(pairs: list[tuple[nn.Parameter, Any]], m: int, blocks: GemvBlocks | None
               ) -> list[Callable[[], object]]:
    w0, norm0 = pairs[0]
    x, res = (_randn(m, w0.shape[1], w0) for _ in range(2))
    if blocks is None:  # what the layer runs without the fusion: the norm, the planned projection
        return [lambda w=w, nm=nm: dense_linear(rms_norm(x, nm.weight, nm.eps, res)[0], w)
                for w, nm in pairs]
    if not gemv_rmsnorm_supports(x, res, norm0.weight, w0, gemv_scale(w0)):
        return []
    return [lambda w=w, nm=nm: gemv_rmsnorm(x, res, nm.weight, nm.eps, w, None, blocks,
                                            gemv_scale(w))
            for w, nm in pairs]


def gated_calls(pairs: list[tuple[nn.Parameter, Any]], m: int, blocks: GemvBlocks | None
                ) -> list[Callable[[], object]]:
    w0, norm0 = pairs[0]
    x, res = (_randn(m, w0.shape[1], w0) for _ in range(2))
    if blocks is None:  # the norm and gate_up as planned just before, then silu_and_mul
        def unfused(w: nn.Parameter, nm: Any) -> object:
            plan = w.__dict__.get("gemv_norm_plan")
            tile = None if plan is None else plan.blocks_for(m)
            if tile is not None:
                return silu_and_mul(gemv_rmsnorm(x, res, nm.weight, nm.eps, w, None, tile,
                                                 gemv_scale(w))[0])
            return silu_and_mul(dense_linear(rms_norm(x, nm.weight, nm.eps, res)[0], w))

        return [lambda w=w, nm=nm: unfused(w, nm) for w, nm in pairs]
    if not gemv_rmsnorm_swiglu_supports(x, res, norm0.weight, w0, gemv_scale(w0)):
        return []
    return [lambda w=w, nm=nm: gemv_rmsnorm_swiglu(x, res, nm.weight, nm.eps, w, blocks,
                                                   gemv_scale(w))
            for w, nm in pairs]
