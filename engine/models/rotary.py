"""Rotary position embedding, HF convention (rotate_half over the two halves of head_dim).

Supports rope_type "default" and "llama3" (Llama 3.1 frequency scaling). Both have an attention
scaling of 1.0, so cos/sin are used as computed. Inverse frequencies are computed once on the
CPU in fp32 (a plain attribute, not a buffer: `model.to(bf16)` and meta-device init leave it alone)
and copied to the positions' device on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.lazy_kernels import has_triton, kernel

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config: `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling` attributes (transformers 4)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:  # [head_dim // 2] fp32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend
    between (same formula and op order as transformers' `_compute_llama3_parameters`)."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


cos_sin_cache = kernel("rotary", "cos_sin_cache")
rotary_embedding = kernel("rotary", "rotary_embedding")


@dataclass
class RopeInputs:
    """What every layer needs to rotate its q/k, computed once per step: cos/sin tables on the
    CPU path, or the positions and the whole-context cos|sin cache for the fused CUDA kernel."""

    cos: torch.Tensor | None = None  # [T, head_dim]
    sin: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [T] int64
    cache: torch.Tensor | None = None  # [max_positions, head_dim] fp32


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict[str, Any], max_positions: int = 0,
                 kernel_inputs: bool = False) -> None:
        """`kernel_inputs`: hand out the fused kernels' inputs on every device, not only on
        CUDA (the Triton attention backend fuses the rotation with its KV store; on CPU its
        kernels run in Triton's interpreter)."""
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
        inv_freq = default_inv_freq(head_dim, params["rope_theta"])
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, params)
        self.inv_freq = inv_freq  # [head_dim // 2] fp32, plain attribute (see module doc)
        self.max_positions = max_positions
        self.kernel_inputs = kernel_inputs
        self._cache: torch.Tensor | None = None  # fused path: built once, on first CUDA use

    def inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """The step's rotary inputs: the fused kernels' on CUDA (or with `kernel_inputs`),
        cos/sin tables elsewhere."""
        fused = positions.is_cuda or self.kernel_inputs
        if fused and has_triton() and self.max_positions:
            if self._cache is None:  # before any CUDA-graph capture: the first (eager) step
                self._cache = cos_sin_cache(self.inv_freq, self.max_positions, positions.device)
            return RopeInputs(positions=positions, cache=self._cache)
        cos, sin = self(positions, dtype)
        return RopeInputs(cos=cos, sin=sin)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T] -> cos, sin: [T, head_dim]
        """cos/sin tables for `positions`, computed in fp32 and cast to `dtype`.

        Side effect: moves the cached inverse frequencies to the positions' device once."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], cos/sin: [T, head_dim] -> rotated x (HF rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half(x)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_qk(
    rope: RopeInputs, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [T, H, D] and k [T, Hkv, D]: in place by the fused kernel, or new tensors."""
    if rope.cache is not None:
        rotary_embedding(rope.positions, q, k, rope.cache)
        return q, k
    return apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
