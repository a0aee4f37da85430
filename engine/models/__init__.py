"""Model classes by HF architecture name (or model_type, for configs without `architectures`,
such as those transformers parses from GGUF files or builds from config classes)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.models.granitemoe import GraniteMoeForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from engine.attention.backend import AttentionBackend
    from engine.config import EngineConfig
    from engine.distributed.group import SingleRank

MODEL_CLASSES: Mapping[str, type[nn.Module]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    }
)
MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "granitemoe": "GraniteMoeForCausalLM",
    }
)


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The pdserve model class for `hf_config`; ValueError naming the architecture otherwise."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        model_type = getattr(hf_config, "model_type", "")
        architectures = [MODEL_TYPES.get(model_type, f"<model_type {model_type!r}>")]
    for arch in architectures:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ValueError(
        f"model architecture {', '.join(architectures)} is not supported "
        f"(supported: {', '.join(sorted(MODEL_CLASSES))})"
    )


__all__ = ["MODEL_CLASSES", "LlamaForCausalLM", "get_model_class"]


def load_model(config: EngineConfig, hf_config: PretrainedConfig, backend: AttentionBackend,
               device: torch.device, dtype: torch.dtype, tp: SingleRank | None = None
               ) -> nn.Module:
    """`config.model`'s weights in its family's module on `device`, built quantized as
    `config.quantization` says (this rank's shard with `tp`), in eval mode; on CUDA with
    `config.decode_gemv`, its decode-sized projections planned (engine/models/gemv_plan.py)."""
    from engine.model_loader import iter_model_weights
    from engine.quant import quantization_config

    if config.quantization is not None:  # the model builds quantized layers
        hf_config.quantization_config = quantization_config(config)
    with torch.device(device):
        model = get_model_class(hf_config)(hf_config, backend, tp).to(dtype)
    model.load_weights(iter_model_weights(config.model, dtype, config.quantization, hf_config))
    if config.decode_gemv and device.type == "cuda":  # before any CUDA graph is captured
        from engine.models.gemv_plan import plan_decode_gemv
        from engine.models.gemv_plan_store import PlanStore

        cache = config.decode_gemv_cache
        plan_decode_gemv(model, None if cache is None else PlanStore(cache))
    return model.eval()
