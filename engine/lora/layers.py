"""A projection with batched LoRA: the base output plus, for every token, its adapter's delta.

NOTE: how one batch mixes adapters (Punica's idea). Every wrapped projection keeps the weights
of all `max_loras` device slots stacked:

    lora_a  [S, n_slices * R, in]   slice i's A (zero-padded to rank R) in rows [i*R, (i+1)*R)
    lora_b  [S, out, R]             slice i's B · scaling in rows offsets[i]..offsets[i+1]

A fused projection (q/k/v, gate/up) has one slice per HF projection it holds. Each token t
carries a slot index slots[t] (-1: the base model); the delta is a shrink to R columns per slice
then an expand back to that slice's rows, `y[t] += B_s (A_s x[t])`, for every token in one
kernel call whatever its adapter (kernels/lora.py). Zero padding makes a lower rank or a
projection the adapter does not target contribute nothing.

`LoRAContext.slots` is set by the model runner before each forward (engine/lora/slots.py); a
decode step replayed from a CUDA graph reads a static buffer instead (engine/cuda_graphs.py).
"""

from __future__ import annotations

import torch
from torch import nn


class LoRAContext:
    """The step's token -> slot map [T] int32 on the device, or None: no adapter this step."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None


def _apply(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
           y: torch.Tensor, offsets: tuple[int, ...]) -> None:
    if x.is_cuda:
        from kernels.lora import lora_apply
    else:
        from kernels.lora import lora_apply_ref as lora_apply
    lora_apply(x, a, b, slots, y, offsets)


class LoRALinear(nn.Module):
    """`base` (any [T, in] -> [T, out] projection) plus the batched LoRA delta of its slices
    (`slices`: HF projection name -> its output width, in row order)."""

    def __init__(
        self, base: nn.Module, in_features: int, slices: dict[str, int], max_loras: int,
        max_rank: int, ctx: LoRAContext, dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.ctx = ctx
        self.in_features = in_features
        self.slice_names = list(slices)
        self.rank = max_rank
        offsets = [0]
        for width in slices.values():
            offsets.append(offsets[-1] + width)
        self.offsets = tuple(offsets)
        n = len(slices)
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, n * max_rank, in_features, dtype=dtype,
                                  device=device), persistent=False)
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, offsets[-1], max_rank, dtype=dtype, device=device),
            persistent=False)

    def slice_width(self, name: str) -> int:
        i = self.slice_names.index(name)
        return self.offsets[i + 1] - self.offsets[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.ctx.slots
        if slots is not None:
            _apply(x.contiguous(), self.lora_a, self.lora_b, slots, y, self.offsets)
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's (A [r, in], B·scale [out, r]) per slice into `slot`; slices it
        does not adapt are zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, name in enumerate(self.slice_names):
            if name not in weights:
                continue
            a, b = weights[name]
            r = a.shape[0]
            lo = i * self.rank
            self.lora_a[slot, lo:lo + r].copy_(a)
            self.lora_b[slot, self.offsets[i]:self.offsets[i + 1], :r].copy_(b)
