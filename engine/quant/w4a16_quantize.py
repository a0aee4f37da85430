"""The repository's own 4-bit quantizer and checkpoint writers: an unquantized HF folder in, an
AWQ, GPTQ or compressed-tensors pack-quantized folder out (engine/quant/w4a16_checkpoint.py
reads them), for tests and benchmarks. Round-to-nearest per group, no calibration data: the
point is the formats, not the quality.

    symmetric   s = amax(|w|) / 7, zero 8:                w = (q - 8) * s
    asymmetric  s = (max(w, 0) - min(w, 0)) / 15, zero = round(-min(w, 0) / s)
    act_order   input rows grouped by descending column norm (GPTQ's desc_act order, with the
                norm standing in for its Hessian diagonal): g_idx[order[i]] = i // group_size;
                projections reading the same input (q/k/v, gate/up) share one order, as
                GPTQ's do (their Hessian is the same)

Scales are rounded to fp16 before the codes are chosen (the formats store fp16 scales), so
`dequantize(quantize(w))` is exactly what a reader of the written checkpoint computes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.quant.w4a16 import W4A16Weight, dequantize
from engine.quant.w4a16_checkpoint import AWQ_NIBBLE_OF_COLUMN, IN_ORDER
from engine.quant.w4a16_config import PACK_QUANTIZED
from kernels.w4a16 import pack_rows


def act_order_of(weights: list[torch.Tensor]) -> torch.Tensor:
    """[K]: the input rows by descending norm of their columns over `weights` ([N_i, K] each)."""
    norms = sum(w.float().square().sum(dim=0) for w in weights)
    return torch.argsort(norms, descending=True, stable=True)


def quantize(weight: torch.Tensor, group_size: int, symmetric: bool = True,
             act_order: bool | torch.Tensor = False) -> W4A16Weight:
    """[N, K] float -> 4-bit codes with per-group fp16-exact scales (group_size -1: one group).
    `act_order`: True orders the groups by this weight's columns, or give the order [K]."""
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    w = weight.float().t()  # [K, N]
    g_idx = None
    if act_order is not False:
        order = act_order_of([weight]) if act_order is True else act_order
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // size
    groups = torch.arange(k) // size if g_idx is None else g_idx
    grouped = w[torch.argsort(groups, stable=True)].view(k // size, size, n)
    if symmetric:
        scales = grouped.abs().amax(dim=1) / 7
    else:
        scales = (grouped.amax(dim=1).clamp_min(0) - grouped.amin(dim=1).clamp_max(0)) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales)).half().float()  # [G, N]
    if symmetric:
        zeros = torch.full_like(scales, 8)
    else:
        zeros = (-grouped.amin(dim=1).clamp_max(0) / scales).round().clamp(0, 15)
    codes = (w / scales[groups] + zeros[groups]).round().clamp(0, 15)
    return W4A16Weight(codes.to(torch.uint8), scales, zeros.to(torch.uint8), size, g_idx)


def pack_columns(values: torch.Tensor, nibble_of_column: tuple[int, ...]) -> torch.Tensor:
    """[R, 8 C] ints 0..15 -> [R, C] int32: column 8 c + j into nibble `nibble_of_column[j]`."""
    r, cols = values.shape
    if cols % 8:
        raise ValueError(f"pack_columns needs columns in multiples of 8, got {cols}")
    packed = torch.zeros(r, cols // 8, dtype=torch.int64)
    for j, nibble in enumerate(nibble_of_column):
        packed |= values[:, j::8].to(torch.int64) << (4 * nibble)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_tensors(prefix: str, w: W4A16Weight) -> dict[str, torch.Tensor]:
    if w.g_idx is not None:
        raise ValueError("AWQ checkpoints have no act-order groups")
    return {f"{prefix}.qweight": pack_columns(w.codes, AWQ_NIBBLE_OF_COLUMN),
            f"{prefix}.qzeros": pack_columns(w.zeros, AWQ_NIBBLE_OF_COLUMN),
            f"{prefix}.scales": w.scales.half()}


def gptq_tensors(prefix: str, w: W4A16Weight) -> dict[str, torch.Tensor]:
    """The v1 format: each zero stored minus one (so a zero of 0 cannot be written)."""
    if (w.zeros == 0).any():
        raise ValueError("the gptq v1 format cannot store a zero of 0")
    return {f"{prefix}.qweight": pack_rows(w.codes),
            f"{prefix}.qzeros": pack_columns(w.zeros - 1, IN_ORDER),
            f"{prefix}.scales": w.scales.half(),
            f"{prefix}.g_idx": w.groups().to(torch.int32)}


def compressed_tensors_tensors(prefix: str, w: W4A16Weight) -> dict[str, torch.Tensor]:
    """Codes and zero points offset by 8 as signed int4 (the same nibbles as ours); no zero
    point tensor when symmetric."""
    n, k = w.shape
    out = {f"{prefix}.weight_packed": pack_columns(w.codes.t(), IN_ORDER),
           f"{prefix}.weight_scale": w.scales.t().contiguous().half(),
           f"{prefix}.weight_shape": torch.tensor([n, k])}
    if not (w.zeros == 8).all():
        out[f"{prefix}.weight_zero_point"] = pack_rows(w.zeros.t())
    if w.g_idx is not None:
        out[f"{prefix}.weight_g_idx"] = w.g_idx.to(torch.int32)
    return out


WRITERS = {"awq": awq_tensors, "gptq": gptq_tensors,
           "compressed-tensors": compressed_tensors_tensors}


def quantization_config(fmt: str, group_size: int, symmetric: bool, act_order: bool
                        ) -> dict[str, Any]:
    """config.json's `quantization_config` as AutoAWQ, GPTQModel and llm-compressor write it."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": not symmetric, "version": "gemm", "modules_to_not_convert": None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                "desc_act": act_order, "sym": symmetric, "checkpoint_format": "gptq",
                "static_groups": False, "true_sequential": True, "lm_head": False}
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": PACK_QUANTIZED,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}


def _projection(name: str) -> bool:
    return name.endswith("_proj.weight") and ".experts." not in name


_SIBLINGS = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # same input


def _input_of(name: str) -> str:
    module, proj, _ = name.rsplit(".", 2)
    return f"{module}.{_SIBLINGS.get(proj, proj)}"


def _act_orders(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each projection's input rows order, shared by the projections reading one input."""
    readers: dict[str, list[torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if _projection(name):
            readers.setdefault(_input_of(name), []).append(tensor)
    orders = {key: act_order_of(ws) for key, ws in readers.items()}
    return {name: orders[_input_of(name)] for name in tensors if _projection(name)}


def write_checkpoint(src: str | Path, dst: str | Path, fmt: str, group_size: int = 32,
                     symmetric: bool = True, act_order: bool = False
                     ) -> dict[str, torch.Tensor]:
    """`src` (an unquantized HF folder, one or more safetensors files) quantized into `dst` in
    format `fmt`: its other files copied, config.json given the quantization_config. Returns
    the de-quantized fp32 weights under HF names (what the written checkpoint stands for)."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
        (dst / file.name).unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    out, dequantized = {}, {}
    orders = _act_orders(tensors) if act_order else {}
    for name, tensor in tensors.items():
        if not _projection(name):
            out[name] = dequantized[name] = tensor
            continue
        w = quantize(tensor, group_size, symmetric, orders.get(name, False))
        out.update(WRITERS[fmt](name.removesuffix(".weight"), w))
        dequantized[name] = dequantize(w)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group_size, symmetric, act_order)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized
