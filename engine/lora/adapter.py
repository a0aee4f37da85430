"""Read a PEFT LoRA adapter from disk: `adapter_config.json` + `adapter_model.safetensors`
(or PEFT's older `adapter_model.bin`).

PEFT adds `scaling · B A x` to a projection's output, with A [r, in], B [out, r] and
scaling = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`). The scaling is folded into B
here, once, so the batched kernels compute `(x Aᵀ) Bᵀ` only. Tensors are named by the HF module
they adapt (`...layers.3.self_attn.q_proj.lora_A.weight`); each (layer, projection) pair becomes
one entry. Everything is checked before anything is kept: a bad adapter raises ValueError
naming the adapter and the tensor or field, and changes nothing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.request import LoRARequest

# The projections an adapter may target (HF names); q/k/v and gate/up land in fused modules.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(PROJECTIONS)
    + r")\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)
# adapter_config.json fields whose non-default values pdserve cannot honour
_UNSUPPORTED = {
    "use_dora": (False, None), "fan_in_fan_out": (False, None), "modules_to_save": (None, []),
    "bias": ("none", None), "alpha_pattern": ({}, None), "lora_bias": (False, None),
    "layer_replication": (None,), "use_qalora": (False, None), "trainable_token_indices": (None,),
}


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (layer, HF projection) its A [r, in] and scaled B
    [out, r] (fp32); `rank` is the largest r over its projections."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.request.lora_name


def load_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """Read and check `request`'s adapter folder (ValueError on anything wrong)."""
    name = request.lora_name
    folder = Path(request.lora_path)
    config = _read_config(name, folder)
    alpha = config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora", False))
    tensors = _read_tensors(name, folder)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.search(key)
        if m is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not supported "
                             f"(only lora_A/lora_B of {', '.join(PROJECTIONS)})")
        if tensor.dim() != 2:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} has shape "
                             f"{tuple(tensor.shape)}, expected a matrix")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {folder}")
    weights = {}
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{proj}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {name!r}: {where} has no {missing} tensor")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: {where}.lora_B has shape "
                             f"{tuple(b.shape)}, expected [out, {rank}] to match lora_A")
        if rank > max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r}: {where} has rank {rank}, above "
                             f"max_lora_rank {max_lora_rank}")
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        weights[(layer, proj)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(request, rank, weights)


def _read_config(name: str, folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {folder}")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not "
                         f"LORA")
    for field, allowed in _UNSUPPORTED.items():
        if field in config and config[field] not in allowed:
            raise ValueError(f"LoRA adapter {name!r}: {field}={config[field]!r} is not "
                             f"supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise ValueError(f"LoRA adapter {name!r}: target_modules {unknown} are not "
                             f"supported (supported: {', '.join(PROJECTIONS)})")
    return config


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    safetensors = folder / "adapter_model.safetensors"
    if safetensors.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors), device="cpu")
        except Exception as exc:  # a truncated or foreign file: safetensors' own errors vary
            raise ValueError(f"LoRA adapter {name!r}: cannot read {safetensors}: {exc}") from None
    legacy = folder / "adapter_model.bin"
    if legacy.is_file():
        try:
            return torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"LoRA adapter {name!r}: cannot read {legacy}: {exc}") from None
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors (or .bin) in "
                     f"{folder}")
