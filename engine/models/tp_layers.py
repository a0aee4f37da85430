"""Tensor-parallel linear and embedding layers, and how each loads its shard of an HF tensor.

Every parameter carries a `weight_loader(param, rows, tensor, name)` that copies this rank's part
of the full HF tensor into rows `rows` of the (local) parameter; `LlamaForCausalLM.load_weights`
calls it. Layouts (tp ranks, this rank r):

    column-parallel  W [out, in]: rank r holds rows `source_rows`; output stays split by rank
    row-parallel     W [out, in]: rank r holds columns `source_cols`; partial outputs are
                     all-reduced, the bias (if any) added once after the sum
    vocab-parallel   E [V, hidden]: rank r holds rows vocab_shard(V, tp, r) (padded with zeros);
                     a token outside them looks up zeros, the all-reduce adds the owner's row

With one rank every layer is the plain one and no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import SingleRank
from engine.distributed.sharding import vocab_shard

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
            return F.linear(x, self.weight, self.bias)
        return self.reduce(F.linear(x, self.weight))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum, before the all-reduce (what LoRA adds its own to)."""
        return F.linear(x, self.weight)

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
    logits = F.linear(hidden, weight)
    if tp.world_size == 1:
        return logits
    return tp.gather_last_dim(logits)[:, :vocab_size]
