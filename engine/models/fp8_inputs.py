"""FP8 projections fed rows already quantized by the kernel that makes them: the RMSNorm before
qkv_proj and gate_up_proj (kernels/rmsnorm_fp8.py) and the SwiGLU before down_proj
(kernels/silu_mul_fp8.py), in place of a separate per-token quantization (kernels/fp8_quant.py)
launched by each projection. o_proj's input comes from attention and keeps its own.

Why: quantizing the activations was 0.17 ms of FP8's 2.85 ms decode step at ~250 rows on an
H100 (64 launches a step on the 16-layer 1B model; docs/benchmarks.md "One H100 (2026-12-05):
W1 traced, bf16 and FP8"); three of each layer's four now ride in a kernel that runs anyway.

Each helper returns None where it does not apply: the projection is not an `Fp8Linear`, its
`fused_inputs` is off (it is on by default), or it would not quantize
its rows per token at this token count (`Fp8Linear.takes_fp8_rows`: CUDA, torch._scaled_mm,
bf16, dynamic activation scales, more than W8A16_MAX_TOKENS tokens). The caller then runs the
unfused path; where a helper applies, its result is that path's, bit for bit. Called by
engine/models/tp_layers.py's `rmsnorm_linear` and `silu_mul_linear` where their decode GEMV
fusions (<= 4 tokens) do not apply.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.lazy_kernels import kernel
from engine.quant.fp8 import Fp8Linear

rms_norm_fp8 = kernel("rmsnorm_fp8", "rms_norm_fp8")  # called on CUDA only
silu_mul_fp8 = kernel("silu_mul_fp8", "silu_mul_fp8")


def rmsnorm_fp8_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, proj: nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (proj's output [T, out], x + residual)
    """(proj(norm(x + residual)), x + residual) with the norm quantizing its rows for `proj`;
    None where `proj` would not take them. `norm`: an RMSNorm (its `weight` and `eps`);
    `residual` None: norm(x), and x."""
    if not isinstance(proj, Fp8Linear) or not proj.fused_inputs or not proj.takes_fp8_rows(
            x.shape[0], x.device, x.dtype):
        return None
    q, scale, residual = rms_norm_fp8(x, norm.weight, norm.eps, residual)
    return proj.forward_fp8(q, scale), residual


def silu_mul_fp8_linear(gate_up: torch.Tensor, down: nn.Module) -> torch.Tensor | None:
    """down(silu(gate) * up) with SwiGLU quantizing its rows for `down` ([T, 2I] -> [T, out]);
    None where `down` would not take them."""
    if not isinstance(down, Fp8Linear) or not down.fused_inputs or not down.takes_fp8_rows(
            gate_up.shape[0], gate_up.device, gate_up.dtype):
        return None
    return down.forward_fp8(*silu_mul_fp8(gate_up))
