"""Small building blocks shared by the decoder models.

On CUDA they run pdserve's fused Triton kernels (kernels/rmsnorm.py, kernels/silu_mul.py); on the
CPU the same math in eager torch. Both follow transformers' op order. An fp32 RMSNorm on the CPU is
one `F.rms_norm` call (its ops run in C++, not one Python call each): for fp32 it computes what
HF's op order does, bit for bit (tests/test_cpu_decode_ops.py checks it); for other dtypes HF
casts back before multiplying by the weight, so F.rms_norm normalises the fp32 copy without a
weight and the weight's multiply follows the cast (bit for bit HF's too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.lazy_kernels import has_triton, kernel

_fused_rms_norm = kernel("rmsnorm", "rms_norm")
_fused_silu_and_mul = kernel("silu_mul", "silu_and_mul")
FUSED_KERNELS = has_triton()  # False on a CPU-only platform without it


def use_fused_kernels(x: torch.Tensor) -> bool:
    return FUSED_KERNELS and x.is_cuda


class RMSNorm(nn.Module):
    """Root-mean-square norm with HF's op order: normalize in fp32, cast back, then scale.

    With `residual`, first adds it (the decoder's skip connection) and returns
    (normed, x + residual): one fused kernel on CUDA instead of an add and a norm."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, hidden]
        if use_fused_kernels(x):
            return _fused_rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        weight = self.weight  # once: a parameter's lookup through nn.Module costs ~0.5 us
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            out = F.rms_norm(x, weight.shape, weight, self.eps)
            return out if residual is None else (out, x)
        # HF's x32 * rsqrt(mean(x32^2) + eps), cast, then scaled: the normalisation as one
        # F.rms_norm without a weight (bit for bit the same, fewer ops)
        normed = F.rms_norm(x.float(), weight.shape, None, self.eps).to(x.dtype)
        out = weight * normed
        return out if residual is None else (out, x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    """SwiGLU on a fused gate_up projection: silu(gate) * up."""
    if use_fused_kernels(gate_up):
        return _fused_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
