"""Tensor-parallel linear and embedding layers, and how each loads its shard of an HF tensor.

Every parameter carries a `weight_loader(param, rows, tensor, name)` that copies this rank's part
of the full HF tensor into rows `rows` of the (local) parameter; `LlamaForCausalLM.load_weights`
calls it. Layouts (tp ranks, this rank r):

    column-parallel  W [out, in]: rank r holds rows `source_rows`; output stays split by rank
    row-parallel     W [out, in]: rank r holds columns `source_cols`; partial outputs are
                     all-reduced, the bias (if any) added once after the sum
    vocab-parallel   E [V, hidden]: rank r holds rows vocab_shard(V, tp, r) (padded with zeros);
                     a token outside them looks up zeros, the all-reduce adds the owner's row

With one rank every layer is the plain one and no collective runs. Dense projections (and the
logits) go through `dense_linear`: F.linear, or on CUDA at decode sizes the Triton GEMV where the
load-time plan chose it (engine/models/gemv_plan.py). The same decode GEMVs take an FP8 layer's
weight (engine/quant/fp8.py): its codes as `gemv_weight`, their row scales riding on them as
`gemv_scale`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import SingleRank
from engine.distributed.sharding import vocab_shard
from engine.lazy_kernels import kernel
from engine.models.fp8_inputs import rmsnorm_fp8_linear, silu_mul_fp8_linear

if TYPE_CHECKING:
    from kernels.gemv import GemvBlocks

# called only through a GEMV plan, and plans are made on CUDA only
fp8_gemv = kernel("fp8_gemv", "fp8_gemv")
gemv, gemv_supports = kernel("gemv", "gemv"), kernel("gemv", "gemv_supports")
gemv_rmsnorm = kernel("gemv_rmsnorm", "gemv_rmsnorm")
gemv_rmsnorm_supports = kernel("gemv_rmsnorm", "gemv_rmsnorm_supports")
gemv_rmsnorm_swiglu = kernel("gemv_rmsnorm_swiglu", "gemv_rmsnorm_swiglu")
gemv_rmsnorm_swiglu_supports = kernel("gemv_rmsnorm_swiglu", "gemv_rmsnorm_swiglu_supports")
gemv_silu = kernel("gemv_silu", "gemv_silu")
gemv_silu_supports = kernel("gemv_silu", "gemv_silu_supports")

WeightLoader = Callable[[nn.Parameter, slice, torch.Tensor, str], None]


def copy_rows(param: nn.Parameter, rows: slice, tensor: torch.Tensor, name: str) -> None:
    """The default loader: `tensor` is exactly rows `rows` of the parameter."""
    target = param.data[rows]
    if target.shape != tensor.shape:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    target.copy_(tensor)


def slice_loader(dim: int, part: range | None, full: int | None = None) -> WeightLoader:
    """A loader taking elements `part` of dim `dim` of the HF tensor, after checking that dim's
    full size is `full` (None: no slicing, the default loader)."""
    if part is None:
        return copy_rows

    def load(param: nn.Parameter, rows: slice, tensor: torch.Tensor, name: str) -> None:
        if full is not None and tensor.shape[dim] != full:
            raise ValueError(
                f"weight {name!r} has {tensor.shape[dim]} entries along dim {dim}, "
                f"expected {full}"
            )
        copy_rows(param, rows, tensor.narrow(dim, part.start, len(part)), name)

    return load


def gemv_scale(weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 row scales of an FP8 decode weight (`gemv_weight`); None for a dense one."""
    return weight.__dict__.get("gemv_scale")


def gemv_act_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of the activations a decode weight multiplies: an FP8 layer's (set on its
    codes), else the weight's own."""
    return weight.__dict__.get("gemv_act_dtype", weight.dtype)


def gemv_weight(module: nn.Module | None) -> torch.Tensor | None:
    """The weight the decode GEMVs stream for `module`: a dense projection's, a quantized
    layer's `gemv_weight` (FP8 codes), or None (the module takes no decode GEMV)."""
    if isinstance(module, (Linear, RowParallelLinear)):
        return module.weight
    return module.gemv_weight if _has(module, "gemv_weight") else None


def _has(module: object, name: str) -> bool:
    """Whether `module`'s class defines `name` (a method or property), remembered per class:
    a miss through nn.Module's __getattr__ costs ~1 us and one on the type ~0.4, a few per
    layer every step."""
    key = (type(module), name)
    found = _CLASS_HAS.get(key)
    if found is None:
        found = _CLASS_HAS[key] = hasattr(key[0], name)
    return found


_CLASS_HAS: dict[tuple[type, str], bool] = {}


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [T, in] -> [T, out]
    """F.linear, or kernels/gemv.py where `weight.gemv_plan` (set at load on CUDA) chose the GEMV
    for x's token count (<= 4). Without a plan (CPU, `decode_gemv=False`): F.linear; an FP8
    weight (`gemv_scale`, x of <= 4 tokens on CUDA) then takes kernels/fp8_gemv.py."""
    plan, scale = getattr(weight, "gemv_plan", None), gemv_scale(weight)
    if plan is not None and x.dim() == 2:
        blocks = plan.blocks_for(x.shape[0])
        if blocks is not None and gemv_supports(x, weight, blocks, scale):
            return gemv(x, weight, bias, blocks, scale)
    if scale is not None:
        y = fp8_gemv(x.contiguous(), weight, scale)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, down: nn.Module) -> torch.Tensor | None:
    """down(silu(gate) * up) as one GEMV (kernels/gemv_silu.py) where `down`'s decode weight's
    `gemv_silu_plan` chose it for gate_up's token count, else with SwiGLU quantizing its rows
    for an FP8 `down` (engine/models/fp8_inputs.py); None where neither applies."""
    if _has(down, "silu_mul_linear"):  # a wrapper's own (multi-LoRA: engine/lora/layers.py)
        return down.silu_mul_linear(gate_up)
    fused = _silu_mul_gemv(gate_up, down)
    return fused if fused is not None else silu_mul_fp8_linear(gate_up, down)


def _silu_mul_gemv(gate_up: torch.Tensor, down: nn.Module) -> torch.Tensor | None:
    w = gemv_weight(down)
    plan = getattr(w, "gemv_silu_plan", None)
    if plan is None or isinstance(down, Linear) or gate_up.dim() != 2:
        return None
    blocks = plan.blocks_for(gate_up.shape[0])
    if blocks is None or down.bias is not None or not gemv_silu_supports(
            gate_up, w, blocks, gemv_scale(w)):
        return None
    partial = gemv_silu(gate_up, w, blocks, gemv_scale(w))
    tp = getattr(down, "tp", None)  # quantized layers run on one rank
    return partial if tp is None or tp.world_size == 1 else down.reduce(partial)


def rmsnorm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, proj: nn.Module
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(proj(norm(x + residual)), x + residual) as one GEMV (kernels/gemv_rmsnorm.py) where
    `proj.weight`'s `gemv_norm_plan` chose it for x's token count, else with the norm
    quantizing its rows for an FP8 `proj` (engine/models/fp8_inputs.py); None where neither
    applies. `norm`: an RMSNorm (its `weight` and `eps`); `residual` None: norm(x), and x."""
    if _has(proj, "rmsnorm_linear"):  # a wrapper's own (multi-LoRA: engine/lora/layers.py)
        return proj.rmsnorm_linear(x, residual, norm)
    fused = _rmsnorm_gemv(x, residual, norm, proj)
    return fused if fused is not None else rmsnorm_fp8_linear(x, residual, norm, proj)


def _rmsnorm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, proj: nn.Module
) -> tuple[torch.Tensor, torch.Tensor] | None:
    planned = rmsnorm_gemv_plan(x, residual, norm, proj)
    if planned is None:
        return None
    w, blocks, scale = planned
    return gemv_rmsnorm(x, residual, norm.weight, norm.eps, w, proj.bias, blocks, scale)


def rmsnorm_gemv_plan(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, proj: nn.Module | None
) -> tuple[torch.Tensor, GemvBlocks, torch.Tensor | None] | None:
    """(the weight, the tile, an FP8 weight's scales) where `proj.weight`'s `gemv_norm_plan`
    chose the fused norm + projection GEMV for x's token count; None where it did not, or
    where `proj` wraps its own (multi-LoRA)."""
    if proj is None or _has(proj, "rmsnorm_linear"):
        return None
    w = gemv_weight(proj)
    plan = getattr(w, "gemv_norm_plan", None)
    if plan is None or isinstance(proj, RowParallelLinear) or x.dim() != 2:
        return None
    blocks, scale = plan.blocks_for(x.shape[0]), gemv_scale(w)
    if blocks is None or not gemv_rmsnorm_supports(x, residual, norm.weight, w, scale):
        return None
    return w, blocks, scale


def rmsnorm_swiglu_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, gate_up: nn.Module
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(silu(gate) * up of gate_up(norm(x + residual)), x + residual) as one GEMV
    (kernels/gemv_rmsnorm_swiglu.py) where `gate_up.weight`'s `gemv_norm_silu_plan` chose it;
    None where it did not."""
    if _has(gate_up, "rmsnorm_swiglu_linear"):  # a wrapper's own (engine/lora/layers.py)
        return gate_up.rmsnorm_swiglu_linear(x, residual, norm)
    w = gemv_weight(gate_up)
    plan = getattr(w, "gemv_norm_silu_plan", None)
    if plan is None or isinstance(gate_up, RowParallelLinear) or gate_up.bias is not None:
        return None
    blocks = plan.blocks_for(x.shape[0]) if x.dim() == 2 else None
    scale = gemv_scale(w)
    if blocks is None or not gemv_rmsnorm_swiglu_supports(x, residual, norm.weight, w, scale):
        return None
    return gemv_rmsnorm_swiglu(x, residual, norm.weight, norm.eps, w, blocks, scale)


class Linear(nn.Linear):
    """`nn.Linear` (a column-parallel shard, or the whole projection on one rank) through
    `dense_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b, where x_r is this rank's slice of the input features."""

    def __init__(
        self, in_features: int, out_features: int, cols: range, bias: bool, tp: SingleRank
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, len(cols)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        sharded = tp.world_size > 1
        self.weight.weight_loader = slice_loader(1, cols if sharded else None, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return dense_linear(x, self.weight, self.bias)
        return self.reduce(dense_linear(x, self.weight))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum, before the all-reduce (what LoRA adds its own to)."""
        return dense_linear(x, self.weight)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial`, plus the bias."""
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: SingleRank) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = vocab_shard(vocab_size, tp.world_size, tp.rank)
        self.weight = nn.Parameter(torch.zeros(len(self.rows), hidden_size))
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, rows: slice, tensor: torch.Tensor, name: str) -> None:
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(
                f"weight {name!r} has {tensor.shape[0]} rows, expected {self.vocab_size}"
            )
        real = range(self.rows.start, min(self.rows.stop, self.vocab_size))
        param.data.zero_()
        copy_rows(param, slice(0, len(real)), tensor[real.start:real.stop], name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: SingleRank
) -> torch.Tensor:
    """[N, hidden] x this rank's lm_head rows -> [N, V] logits on rank 0 (other ranks: their
    own [N, V/tp] part, unused)."""
    logits = dense_linear(hidden, weight)
    if tp.world_size == 1:
        return logits
    return tp.gather_last_dim(logits)[:, :vocab_size]
