"""W4A16 checkpoints on disk (formats: engine/quant/w4a16_config.py): each quantized projection's
tensors read into a `W4A16Weight` under the HF name `X.weight`, every other tensor as it is.

    awq                 X.qweight [K, N/8] int32, 8 columns per int32 in AWQ's interleaved order
                        (nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]); X.qzeros
                        [K/G, N/8] int32 likewise; X.scales [K/G, N] fp16; W = (q - z) * s
    gptq                X.qweight [K/8, N] int32, 8 rows per int32 (row 8r + i in nibble i);
                        X.qzeros [K/G, N/8] int32, 8 columns per int32, each stored zero - 1 in
                        the v1 format; X.scales [K/G, N]; X.g_idx [K] each input row's group
    compressed-tensors  X.weight_packed [N, K/8] int32, 8 columns per int32 in order, codes
                        offset by 8 (signed -8..7); X.weight_scale [N, K/G]; X.weight_zero_point
                        [N/8, K/G] int32 packed along N likewise (asymmetric only; an unpacked
                        [N, K/G] int8 is read too); X.weight_shape [2] = (N, K); X.weight_g_idx
                        [K] with actorder "group"

A missing or wrongly shaped tensor is a ValueError naming it and the format. All-zero biases of
4-bit projections (AutoGPTQ writes them for unbiased models) are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.quant.fp8_checkpoint import checkpoint_quantization
from engine.quant.w4a16 import W4A16Weight, normalize_g_idx
from engine.quant.w4a16_config import gptq_zero_offset, w4a16_format
from kernels.w4a16 import unpack_rows

AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # the inverse of AWQ's order [0,2,4,6,1,3,5,7]
IN_ORDER = tuple(range(8))


class _Module:
    """The tensors `prefix + suffix` of one quantized projection, each checked as it is read."""

    def __init__(self, where: dict[str, Any], prefix: str, fmt: str, used: set[str]) -> None:
        self.where, self.prefix, self.fmt, self.used = where, prefix, fmt, used

    def get(self, suffix: str, required: bool = True) -> torch.Tensor | None:
        name = self.prefix + suffix
        if name not in self.where:
            if required:
                raise ValueError(f"tensor {name!r} is missing ({self.fmt} format)")
            return None
        self.used.add(name)
        return self.where[name].get_tensor(name)

    def error(self, suffix: str, tensor: torch.Tensor, expected: str) -> ValueError:
        return ValueError(f"tensor {self.prefix + suffix!r} ({self.fmt} format) has shape "
                         f"{tuple(tensor.shape)} {tensor.dtype}, expected {expected}")

    def packed(self, suffix: str, rows: int | None = None, cols: int | None = None
               ) -> torch.Tensor:
        """An int32 2-D tensor, of `rows` x `cols` where given."""
        t = self.get(suffix)
        if (t.dtype != torch.int32 or t.dim() != 2 or rows not in (None, t.shape[0])
                or cols not in (None, t.shape[1])):
            raise self.error(suffix, t, f"[{rows or '?'}, {cols or '?'}] int32")
        return t


def unpack_columns(packed: torch.Tensor, nibble_of_column: tuple[int, ...]) -> torch.Tensor:
    """[R, C] int32 -> [R, 8 C] uint8: column 8 c + j from nibble `nibble_of_column[j]`."""
    shifts = 4 * torch.tensor(nibble_of_column, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 15).reshape(packed.shape[0], -1).to(torch.uint8)


def _group_size(m: _Module, suffix: str, scales: torch.Tensor, k: int, n: int,
                configured: int | None, transposed: bool = False) -> int:
    """G from the scales' shape ([K/G, N], or [N, K/G] `transposed`), checked against the config
    (-1: one group) where it names one."""
    groups = scales.shape[1 if transposed else 0] if scales.dim() == 2 else 0
    other = scales.shape[0 if transposed else 1] if scales.dim() == 2 else -1
    expected = k if configured == -1 else configured
    if other != n or groups == 0 or k % groups or expected not in (None, k // groups):
        want = "?" if expected is None else k // expected
        raise m.error(suffix, scales, f"[{n}, {want}]" if transposed else f"[{want}, {n}]")
    return k // groups


def read_awq(m: _Module, qc: dict[str, Any]) -> W4A16Weight:
    qweight = m.packed(".qweight")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    scales = m.get(".scales")
    group = _group_size(m, ".scales", scales, k, n, qc.get("group_size", qc.get("q_group_size")))
    qzeros = m.packed(".qzeros", k // group, n // 8)
    return W4A16Weight(unpack_columns(qweight, AWQ_NIBBLE_OF_COLUMN), scales.float(),
                       unpack_columns(qzeros, AWQ_NIBBLE_OF_COLUMN), group)


def read_gptq(m: _Module, qc: dict[str, Any]) -> W4A16Weight:
    qweight = m.packed(".qweight")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if n % 8:
        raise m.error(".qweight", qweight, "N a multiple of 8")
    scales = m.get(".scales")
    group = _group_size(m, ".scales", scales, k, n, qc["group_size"])
    qzeros = m.packed(".qzeros", k // group, n // 8)
    zeros = unpack_columns(qzeros, IN_ORDER) + gptq_zero_offset(qc)
    g_idx = m.get(".g_idx", required=bool(qc.get("desc_act")))
    if g_idx is not None:
        g_idx = normalize_g_idx(g_idx, k, group, m.prefix + ".g_idx")
    return W4A16Weight(unpack_rows(qweight), scales.float(), zeros, group, g_idx)


def read_compressed_tensors(m: _Module, qc: dict[str, Any]) -> W4A16Weight:
    packed = m.packed(".weight_packed")
    shape = m.get(".weight_shape")
    n, cols = packed.shape
    if shape.numel() != 2 or shape.dtype.is_floating_point:
        raise m.error(".weight_shape", shape, "[2] integers (N, K)")
    n_declared, k = (int(v) for v in shape.flatten())
    if n_declared != n or k % 8 or k // 8 != cols:
        raise m.error(".weight_packed", packed,
                      f"[{n_declared}, {k // 8}] int32 with K = {k} a multiple of 8 (weight_shape)")
    scales = m.get(".weight_scale")
    group = _group_size(m, ".weight_scale", scales, k, n, None, transposed=True)
    codes = unpack_columns(packed, IN_ORDER).t().contiguous()  # [K, N]
    zeros = _ct_zeros(m, n, k // group)
    g_idx = m.get(".weight_g_idx", required=False)
    if g_idx is not None:
        g_idx = normalize_g_idx(g_idx, k, group, m.prefix + ".weight_g_idx")
    return W4A16Weight(codes, scales.float().t().contiguous(), zeros, group, g_idx)


def _ct_zeros(m: _Module, n: int, groups: int) -> torch.Tensor:  # -> [K/G, N] uint8
    zp = m.get(".weight_zero_point", required=False)
    if zp is None:  # symmetric: signed zero point 0
        return torch.full((groups, n), 8, dtype=torch.uint8)
    if zp.dtype == torch.int32 and tuple(zp.shape) == ((n + 7) // 8, groups):
        return unpack_rows(zp)[:n].t().contiguous()  # offset by 8 like the codes
    if not zp.dtype.is_floating_point and tuple(zp.shape) == (n, groups):
        return (zp.to(torch.int16) + 8).to(torch.uint8).t().contiguous()
    raise m.error(".weight_zero_point", zp, f"[{(n + 7) // 8}, {groups}] int32 (packed) or "
                  f"[{n}, {groups}] int8")


def _zero_bias_of_4bit(name: str, where: dict[str, Any], main: str) -> bool:
    """An all-zero bias of a 4-bit projection: AutoGPTQ wrote one for every layer, biased in
    the model or not (vLLM skips them too); dropped (a model with that bias then names it as
    missing)."""
    if not name.endswith(".bias") or name.removesuffix(".bias") + main not in where:
        return False
    return not where[name].get_tensor(name).any()


Reader = Callable[[_Module, dict[str, Any]], W4A16Weight]
# format -> (the tensor naming a quantized projection, its companions, the reader)
FORMATS: dict[str, tuple[str, tuple[str, ...], Reader]] = {
    "awq": (".qweight", (".qzeros", ".scales", ".g_idx"), read_awq),
    "gptq": (".qweight", (".qzeros", ".scales", ".g_idx"), read_gptq),
    "compressed-tensors": (".weight_packed", (".weight_scale", ".weight_zero_point",
                                               ".weight_g_idx", ".weight_shape"),
                           read_compressed_tensors),
}


def iter_w4a16_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """(HF name, weight) of a W4A16 checkpoint: each quantized projection as `X.weight`, a
    `W4A16Weight` (its tensors consumed here), every other tensor cast to `dtype`."""
    from engine.model_loader import safetensors_files

    qc = checkpoint_quantization(path)
    fmt = w4a16_format(qc)
    if fmt is None:
        raise ValueError(f"{path!r} is not a W4A16 checkpoint (awq, gptq or compressed-tensors "
                         "pack-quantized quantization_config)")
    main, companions, read = FORMATS[fmt]
    handles = [safe_open(str(f), framework="pt", device="cpu")
               for f in safetensors_files(Path(path))]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118
    used: set[str] = set()
    for name, handle in where.items():
        if name.endswith(companions) or _zero_bias_of_4bit(name, where, main):
            continue
        if not name.endswith(main):
            yield name, handle.get_tensor(name).to(dtype)
            continue
        prefix = name.removesuffix(main)
        if not prefix.endswith("_proj") or ".experts." in prefix:
            raise ValueError(f"tensor {name!r} ({fmt} format): pdserve keeps only the attention "
                             "and MLP projections in 4 bits (not embeddings, lm_head or MoE "
                             "experts)")
        used.add(name)
        yield f"{prefix}.weight", read(_Module(where, prefix, fmt, used), qc)
    orphans = [n for n in where if n.endswith(companions) and n not in used]
    if orphans:
        raise ValueError(f"tensors without a quantized weight in {path!r} ({fmt} format): "
                         f"{orphans[:4]}")
