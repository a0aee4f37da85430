"""FP8 checkpoints on disk: which format a folder holds, and its weights paired with their scales.

Formats read (config.json's `quantization_config`):

    fp8                  vLLM / HF: {"quant_method": "fp8", "activation_scheme": "dynamic" |
                         "static"}; `X.weight` float8_e4m3fn, `X.weight_scale` per tensor ([] or
                         [1]) or per channel ([out] or [out, 1]), `X.input_scale` when static
    compressed-tensors   llm-compressor's FP8 / FP8_DYNAMIC: config_groups whose weights are
                         {num_bits: 8, type: float, strategy: channel | tensor}, activations
                         per token (dynamic) or per tensor (static `input_scale`) or none

Anything else quantized (block-wise `weight_block_size`, 4-bit groups, other methods) is a
ValueError naming the field or tensor and the format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.quant.fp8 import Fp8Weight
from kernels.fp8 import FP8

FP8_FORMATS = ("fp8", "compressed-tensors")
_SCALES = (".weight_scale", ".input_scale")


def checkpoint_quantization(path: str | Path) -> dict[str, Any] | None:
    """The `quantization_config` of an HF folder's config.json (None: none, or not a folder)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    qc = json.loads(config.read_text()).get("quantization_config")
    return qc if isinstance(qc, dict) else None


def fp8_format(path: str | Path) -> str | None:
    """"fp8" or "compressed-tensors" for an FP8 checkpoint pdserve reads, None for an
    unquantized one; ValueError for any other quantized checkpoint."""
    qc = checkpoint_quantization(path)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        _check_fp8(qc)
    elif method == "compressed-tensors":
        _check_compressed_tensors(qc)
    else:
        raise ValueError(f"checkpoint {str(path)!r}: quantization_config.quant_method "
                         f"{method!r} is not supported (pdserve reads fp8 and "
                         "compressed-tensors FP8 checkpoints)")
    return method


def _check_fp8(qc: dict[str, Any]) -> None:
    if qc.get("weight_block_size") is not None:
        raise ValueError(f"quantization_config.weight_block_size {qc['weight_block_size']} "
                         "(fp8 format): block-wise FP8 is not supported, only per-tensor or "
                         "per-channel weight scales")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} (fp8 format) is "
                         "not supported (dynamic or static)")


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format {fmt!r} (compressed-tensors) is not "
                         "supported (float-quantized FP8 only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty (compressed-tensors)")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        _check_ct_args(group.get("weights") or {}, f"{where}.weights", ("channel", "tensor"))
        if group.get("input_activations") is not None:
            _check_ct_args(group["input_activations"], f"{where}.input_activations",
                           ("token", "tensor"))


def _check_ct_args(args: dict[str, Any], where: str, strategies: tuple[str, ...]) -> None:
    kind = (args.get("num_bits"), args.get("type"))
    if kind != (8, "float"):
        raise ValueError(f"{where}: num_bits {kind[0]} type {kind[1]!r} (compressed-tensors) "
                         "is not supported: FP8 schemes only (num_bits 8, type float)")
    if args.get("strategy") not in strategies:
        raise ValueError(f"{where}.strategy {args.get('strategy')!r} (compressed-tensors) is "
                         f"not supported ({' or '.join(strategies)})")


def iter_fp8_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """(HF name, weight) of a checkpoint served as "fp8": an unquantized one as `iter_weights`
    gives it (the layers quantize on load); an FP8 one with each fp8 `X.weight` as an
    `Fp8Weight` holding its scales (consumed here), every other tensor cast to `dtype`."""
    from engine.model_loader import iter_weights, safetensors_files

    fmt = fp8_format(path)
    if fmt is None:
        yield from iter_weights(path, dtype)
        return
    handles = [safe_open(str(f), framework="pt", device="cpu")
               for f in safetensors_files(Path(path))]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118
    used: set[str] = set()
    for name, handle in where.items():
        if name.endswith(_SCALES):
            continue
        tensor = handle.get_tensor(name)
        if tensor.dtype != FP8:
            yield name, tensor.to(dtype)
            continue
        weight = _fp8_weight(name, tensor, where, fmt)
        used.update(n for n in (f"{name}_scale", name.removesuffix(".weight") + ".input_scale"))
        yield name, weight
    orphans = [n for n in where if n.endswith(_SCALES) and n not in used]
    if orphans:
        raise ValueError(f"scales without an FP8 weight in {path!r} ({fmt} format): {orphans[:4]}")


def _fp8_weight(name: str, qweight: torch.Tensor, where: dict, fmt: str) -> Fp8Weight:
    if not name.endswith("_proj.weight") or ".experts." in name:
        raise ValueError(f"tensor {name!r} is float8_e4m3fn ({fmt} format): pdserve keeps only "
                         "the attention and MLP projections in FP8 (not embeddings, lm_head "
                         "or MoE experts)")
    if qweight.dim() != 2:
        raise ValueError(f"tensor {name!r} ({fmt} format) has shape {tuple(qweight.shape)}, "
                         "expected [out, in]")
    scale_name = f"{name}_scale"
    if scale_name not in where:
        hint = " (block-wise weight_scale_inv is not supported)" if f"{name}_scale_inv" in where \
            else ""
        raise ValueError(f"FP8 tensor {name!r} has no {scale_name!r} ({fmt} format){hint}")
    scale = where[scale_name].get_tensor(scale_name).float()
    rows = qweight.shape[0]
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(rows).contiguous()  # per tensor: every row the same
    elif tuple(scale.shape) in ((rows,), (rows, 1)):
        scale = scale.reshape(rows)
    else:
        raise ValueError(f"tensor {scale_name!r} ({fmt} format) has shape "
                         f"{tuple(scale.shape)}: expected per-tensor [] / [1] or per-channel "
                         f"[{rows}] / [{rows}, 1] (block-wise scales are not supported)")
    input_name = name.removesuffix(".weight") + ".input_scale"
    input_scale = None
    if input_name in where:
        input_scale = where[input_name].get_tensor(input_name).float()
        if input_scale.numel() != 1:
            raise ValueError(f"tensor {input_name!r} ({fmt} format) has shape "
                             f"{tuple(input_scale.shape)}: only a per-tensor static scale")
    return Fp8Weight(qweight, scale, input_scale)
