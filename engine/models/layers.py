"""Small building blocks shared by the decoder models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with HF's op order: normalize in fp32, cast back, then scale."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)  # [T, 1]
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    """SwiGLU on a fused gate_up projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
