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

At decode sizes (up to FOLD_MAX_TOKENS tokens) the shrink rides in the base GEMV instead: a
plain (not quantized) projection without bias keeps every slot's A rows under its own weight,

    folded  [N + S * n_slices * R, in]   rows [0, N): the base weight (the base layer's weight
                                         is a view of them); then lora_a[s] for s = 0 .. S-1

so one GEMV (as the load-time decode plan chose it, norm prologue included) yields y and every
slot's t = A_s x, and one launch adds B_s t_s (kernels/lora_fold.py; for gate_up it also applies
SwiGLU). A step without adapters runs the base layer on its view, as the model without LoRA
does, fusions included (engine/models/tp_layers.py asks the wrapper through the
`rmsnorm_linear` / `rmsnorm_swiglu_linear` / `silu_mul_linear` hooks). Quantized or biased
bases, and larger steps, take the shrink-and-expand path above.

`LoRAContext.slots` is set by the model runner before each forward (engine/lora/slots.py); a
decode step replayed from a CUDA graph reads a static buffer instead (engine/cuda_graphs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.lazy_kernels import kernel
from engine.models import tp_layers

lora_fold_expand = kernel("lora_fold", "lora_fold_expand")  # CUDA GEMV plans only

if TYPE_CHECKING:
    from kernels.gemv import GemvBlocks

FOLD_MAX_TOKENS = 4  # up to this many tokens, a step with adapters takes the folded GEMV


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
        a_rows = len(slices) * max_rank
        # [N + S * n_slices * R, local_in] (see the NOTE), or None: this base cannot fold
        self.folded: torch.Tensor | None = None
        if _foldable(base, offsets[-1], local_in, dtype):
            self.folded = _fold(base.weight, max_loras * a_rows)
            lora_a = self.folded[offsets[-1]:].view(max_loras, a_rows, local_in)
        else:
            lora_a = torch.zeros(max_loras, a_rows, local_in, dtype=dtype, device=device)
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, offsets[-1], max_rank, dtype=dtype, device=device),
            persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = self.ctx.slots
        if slots is not None and self._folds(x):
            blocks = _planned(self.base.weight, "gemv_plan", x.shape[0])
            if blocks is not None and tp_layers.gemv_supports(x, self.folded, blocks):
                full = tp_layers.gemv(x, self.folded, None, blocks)
            else:
                full = F.linear(x, self.folded)
            return self._expand(full, slots, blocks is not None and blocks.pdl)
        if self.cols is not None:  # row-parallel over several ranks
            y = self.base.partial(x)
            if slots is not None:
                _apply(x.contiguous(), self.lora_a, self.lora_b, slots, y, self.offsets)
            return self.base.reduce(y)
        y = self.base(x)
        if slots is not None:
            _apply(x.contiguous(), self.lora_a, self.lora_b, slots, y, self.offsets)
        return y

    # ---- the fused decode kernels (engine/models/tp_layers.py's hooks) -------------------------
    def rmsnorm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """tp_layers.rmsnorm_linear for this projection: the base's fusion in a step without
        adapters; with them, the norm and the folded GEMV in one kernel, then the expand. None
        where neither applies (the caller norms, then calls forward)."""
        return self._normed(x, residual, norm, swiglu=False)

    def rmsnorm_swiglu_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                              norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """tp_layers.rmsnorm_swiglu_linear for a gate_up projection: as rmsnorm_linear, SwiGLU
        applied by the base's kernel or by the expand."""
        return self._normed(x, residual, norm, swiglu=True)

    def silu_mul_linear(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """tp_layers.silu_mul_linear for a down projection: SwiGLU in the (folded) GEMV's
        prologue where the plan chose it, then the expand; None where it did not."""
        slots = self.ctx.slots
        if slots is None:
            return tp_layers.silu_mul_linear(gate_up, self.base)
        blocks = _planned(self.base.weight, "gemv_silu_plan", gate_up.shape[0])
        if (blocks is None or not self._folds(gate_up)
                or not tp_layers.gemv_silu_supports(gate_up, self.folded, blocks)):
            return None
        return self._expand(tp_layers.gemv_silu(gate_up, self.folded, blocks), slots, blocks.pdl)

    def _normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                swiglu: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        slots = self.ctx.slots
        if slots is None:
            fuse = tp_layers.rmsnorm_swiglu_linear if swiglu else tp_layers.rmsnorm_linear
            return fuse(x, residual, norm, self.base)
        blocks = _planned(self.base.weight, "gemv_norm_plan", x.shape[0])
        if (blocks is None or not self._folds(x) or (swiglu and len(self.offsets) != 3)
                or not tp_layers.gemv_rmsnorm_supports(x, residual, norm.weight, self.folded)):
            return None
        full, res = tp_layers.gemv_rmsnorm(x, residual, norm.weight, norm.eps, self.folded, None,
                                           blocks)
        return self._expand(full, slots, blocks.pdl, swiglu), res

    def _folds(self, x: torch.Tensor) -> bool:
        return self.folded is not None and x.dim() == 2 and x.shape[0] <= FOLD_MAX_TOKENS

    def _expand(self, full: torch.Tensor, slots: torch.Tensor, pdl: bool,
                swiglu: bool = False) -> torch.Tensor:
        """The folded GEMV's output [T, N + S * n_slices * R] -> y + B_s t_s [T, N] (SwiGLU:
        [T, N / 2]), summed over the ranks for a row-parallel projection."""
        y = lora_fold_expand(full, self.lora_b, slots, self.offsets, swiglu=swiglu, pdl=pdl)
        return y if self.cols is None else self.base.reduce(y)

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


def _foldable(base: nn.Module, rows: int, cols: int, dtype: torch.dtype) -> bool:
    """A plain (not quantized) bias-free projection of `dtype` whose weight is [rows, cols]."""
    if type(base) not in (tp_layers.Linear, tp_layers.RowParallelLinear) or base.bias is not None:
        return False
    w = base.weight
    return tuple(w.shape) == (rows, cols) and w.dtype == dtype and w.is_contiguous()


def _fold(weight: nn.Parameter, extra_rows: int) -> torch.Tensor:
    """[N + extra_rows, in], its first N rows `weight`'s values (zeros below); `weight` becomes
    a view of them (the same Parameter: its plans and loader stay)."""
    n, k = weight.shape
    folded = torch.zeros(n + extra_rows, k, dtype=weight.dtype, device=weight.device)
    folded[:n].copy_(weight.data)
    weight.data = folded[:n]
    return folded


def _planned(weight: torch.Tensor, plan: str, tokens: int) -> GemvBlocks | None:
    """The tile the load-time decode plan `plan` (engine/models/gemv_plan.py) chose for this
    token count, None where there is none (CPU, `decode_gemv=False`, or cuBLAS won)."""
    chosen = getattr(weight, plan, None)
    return None if chosen is None else chosen.blocks_for(tokens)
