"""4-bit weights with 16-bit activations (W4A16): the one form AWQ, GPTQ and compressed-tensors
pack-quantized checkpoints are read into (engine/quant/w4a16_checkpoint.py), before the layer
packs them for its kernels (engine/quant/w4a16_linear.py, kernels/w4a16.py).

    W[n, k] = (codes[k, n] - zeros[g(k), n]) * scales[g(k), n]
    g(k)    = g_idx[k] with act-order (GPTQ desc_act, compressed-tensors actorder "group"),
              else k // group_size

Each format's own convention is folded into `codes` and `zeros` (both unsigned): AWQ's
interleaved nibbles are put in order, GPTQ v1's stored zero is one less than the real one,
compressed-tensors' signed codes and zero points are offset by 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class W4A16Weight:
    """Rows (output channels) of a 4-bit weight W [N, K] (HF's [out, in]), unpacked:
    `codes` [K, n] uint8 0..15, `scales` [K / group_size, n] fp32, `zeros` [K / group_size, n]
    uint8 0..16, `g_idx` [K] int64 (each input row's group) or None (consecutive groups)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:  # (rows, K), as HF's [out, in] weight
        return torch.Size((self.codes.shape[1], self.codes.shape[0]))

    def groups(self) -> torch.Tensor:  # [K] each input row's group
        k = self.codes.shape[0]
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(k, device=self.codes.device) // self.group_size


def dequantize(weight: W4A16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight it stands for, [N, K] in `dtype` (computed in fp32: exact for fp32)."""
    g = weight.groups()
    w = (weight.codes.float() - weight.zeros.float()[g]) * weight.scales.float()[g]  # [K, N]
    return w.t().contiguous().to(dtype)


def concat_rows(parts: list[W4A16Weight], name: str) -> W4A16Weight:
    """Shards of one fused projection (q/k/v, gate/up), in row order, as one weight. They must
    share the group size and the act-order groups (GPTQ computes them from the layer's input,
    which the shards share)."""
    first = parts[0]
    for part in parts[1:]:
        if part.group_size != first.group_size:
            raise ValueError(f"weight {name!r}: fused shards of group sizes "
                             f"{first.group_size} and {part.group_size}")
        if (part.g_idx is None) != (first.g_idx is None) or (
                part.g_idx is not None and not torch.equal(part.g_idx, first.g_idx)):
            raise ValueError(f"weight {name!r}: fused shards with different g_idx (act-order "
                             "groups); pdserve needs them equal")
    if len(parts) == 1:
        return first
    return W4A16Weight(torch.cat([p.codes for p in parts], 1),
                       torch.cat([p.scales for p in parts], 1),
                       torch.cat([p.zeros for p in parts], 1), first.group_size, first.g_idx)


def group_order(weight: W4A16Weight, name: str) -> torch.Tensor | None:
    """The permutation of K that makes act-order groups consecutive (None: already so): rows
    `perm` of W, read in that order, fall in groups k // group_size. ValueError when g_idx
    does not give every group exactly group_size rows."""
    if weight.g_idx is None:
        return None
    k, size = weight.codes.shape[0], weight.group_size
    perm = torch.argsort(weight.g_idx, stable=True)
    consecutive = torch.arange(k, device=perm.device) // size
    if not torch.equal(weight.g_idx[perm], consecutive):
        raise ValueError(f"weight {name!r}: g_idx does not put {size} input rows in each of "
                         f"{k // size} groups (act-order groups pdserve cannot serve)")
    return None if torch.equal(perm, torch.arange(k, device=perm.device)) else perm


def normalize_g_idx(g_idx: torch.Tensor, k: int, group_size: int, name: str) -> torch.Tensor | None:
    """A checkpoint's g_idx [K] as int64, or None when it is the trivial k // group_size."""
    if tuple(g_idx.shape) != (k,) or g_idx.dtype.is_floating_point:
        raise ValueError(f"tensor {name!r} has shape {tuple(g_idx.shape)} {g_idx.dtype}, "
                         f"expected [{k}] integers")
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(k) // group_size):
        return None
    if g_idx.min() < 0 or g_idx.max() >= k // group_size:
        raise ValueError(f"tensor {name!r} names groups outside 0..{k // group_size - 1}")
    return g_idx
