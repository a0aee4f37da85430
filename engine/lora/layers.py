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
    """`base` (any [T, in] -> [T, out] projection) plus the batched LoRA delta of its slices.

    `slices`: per HF projection it holds, in row order, (the rows of it this rank holds, the
    projection's full row count). With tensor parallelism a column-parallel projection (q/k/v,
    gate/up) keeps A whole and B's rows of its slice rows; a row-parallel one (`cols`: the input
    columns this rank holds; o, down) keeps A's columns and B whole, and adds its delta to its
    partial output before the all-reduce: the sum over ranks of B (A_r x_r) is B (A x)."""

    def __init__(
        self, base: nn.Module, in_features: int, slices: dict[str, tuple[range, int]],
        max_loras: int, max_rank: int, ctx: LoRAContext, dtype: torch.dtype,
        device: torch.device, cols: range | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.ctx = ctx
        self.in_features = in_features  # the full projection's
        self.cols = cols  # row-parallel with tensor parallelism: this rank's input columns
        self.slice_names = list(slices)
        self.rows = {name: rows for name, (rows, _) in slices.items()}
        self.full_out = {name: full for name, (_, full) in slices.items()}
        self.rank = max_rank
        offsets = [0]
        for rows, _ in slices.values():
            offsets.append(offsets[-1] + len(rows))
        self.offsets = tuple(offsets)
        local_in = in_features if cols is None else len(cols)
        n = len(slices)
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, n * max_rank, local_in, dtype=dtype,
                                  device=device), persistent=False)
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, offsets[-1], max_rank, dtype=dtype, device=device),
            persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = self.ctx.slots
        if self.cols is not None:  # row-parallel over several ranks
            y = self.base.partial(x)
            if slots is not None:
                _apply(x.contiguous(), self.lora_a, self.lora_b, slots, y, self.offsets)
            return self.base.reduce(y)
        y = self.base(x)
        if slots is not None:
            _apply(x.contiguous(), self.lora_a, self.lora_b, slots, y, self.offsets)
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's (A [r, in], B·scale [out, r]) per slice (whole HF projections)
        into `slot`, this rank's part of each; slices it does not adapt are zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, name in enumerate(self.slice_names):
            if name not in weights:
                continue
            a, b = weights[name]
            if self.cols is not None:
                a = a[:, self.cols.start:self.cols.stop]
            rows = self.rows[name]
            b = b[rows.start:rows.stop]
            r = a.shape[0]
            lo = i * self.rank
            self.lora_a[slot, lo:lo + r].copy_(a)
            self.lora_b[slot, self.offsets[i]:self.offsets[i + 1], :r].copy_(b)
