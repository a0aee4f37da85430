"""The modules a Llama-family model builds its projections, embedding and logits with
(engine/models/llama.py): the dense tensor-parallel ones (engine/models/tp_layers.py), or, as the
config's `quantization_config` asks (one rank only), GGUF kept quantized (engine/quant/layers.py),
FP8 (engine/quant/fp8.py) or AWQ / GPTQ / compressed-tensors 4-bit (engine/quant/w4a16_linear.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.quant.fp8 import FP8_METHOD, Fp8Linear
from engine.quant.layers import GGUFEmbedding, GGUFLinear
from engine.quant.w4a16_config import W4A16_METHODS
from engine.quant.w4a16_linear import W4A16Linear

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from engine.distributed.group import SingleRank

# engine.models.tp_layers is imported where used: engine/models/llama.py imports this module

GGUF_METHOD = "gguf"


def is_gguf_quantized(config: PretrainedConfig) -> bool:
    """Whether the model runner asked for GGUF weights kept quantized (it sets the config's
    `quantization_config`, as HF quantized checkpoints carry it)."""
    qc = getattr(config, "quantization_config", None)
    return isinstance(qc, dict) and qc.get("quant_method") == GGUF_METHOD


def is_fp8_quantized(config: PretrainedConfig) -> bool:
    """Whether the model runner asked for FP8 projections (embeddings and lm_head stay)."""
    qc = getattr(config, "quantization_config", None)
    return isinstance(qc, dict) and qc.get("quant_method") == FP8_METHOD


def is_w4a16_quantized(config: PretrainedConfig) -> bool:
    """Whether the model runner asked for 4-bit projections (AWQ, GPTQ, compressed-tensors)."""
    qc = getattr(config, "quantization_config", None)
    return isinstance(qc, dict) and qc.get("quant_method") in W4A16_METHODS


def _activation_dtype(config: PretrainedConfig) -> torch.dtype | None:
    name = config.quantization_config.get("activation_dtype")
    return None if name is None else getattr(torch, name)


def _check_one_rank(tp: SingleRank, what: str = "GGUF weights kept quantized") -> None:
    if tp.world_size > 1:
        raise ValueError(f"{what} run on one rank (tensor_parallel_size 1)")


def linear(config: PretrainedConfig, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """A column-parallel (or one-rank) projection: `nn.Linear`, or `GGUFLinear` / `Fp8Linear` /
    `W4A16Linear` when the config asks for GGUF kept quantized / FP8 / 4-bit (one rank: the
    model runner refuses tensor parallelism for them)."""
    if is_gguf_quantized(config):
        return GGUFLinear(in_features, out_features, bias, _activation_dtype(config))
    if is_fp8_quantized(config):
        return Fp8Linear(in_features, out_features, bias)
    if is_w4a16_quantized(config):
        return W4A16Linear(in_features, out_features, bias)
    from engine.models.tp_layers import Linear  # nn.Linear through dense_linear (decode GEMV)

    return Linear(in_features, out_features, bias=bias)


def row_parallel_linear(
    config: PretrainedConfig,
    in_features: int,
    out_features: int,
    cols: range,
    bias: bool,
    tp: SingleRank,
) -> nn.Module:
    """`RowParallelLinear`, or a quantized layer (GGUF, FP8, W4A16; one rank)."""
    if is_gguf_quantized(config):
        _check_one_rank(tp)
        return GGUFLinear(in_features, out_features, bias, _activation_dtype(config))
    if is_fp8_quantized(config):
        _check_one_rank(tp, "FP8 weights")
        return Fp8Linear(in_features, out_features, bias)
    if is_w4a16_quantized(config):
        _check_one_rank(tp, "4-bit (W4A16) weights")
        return W4A16Linear(in_features, out_features, bias)
    from engine.models.tp_layers import RowParallelLinear

    return RowParallelLinear(in_features, out_features, cols, bias, tp)


def vocab_embedding(config: PretrainedConfig, tp: SingleRank) -> nn.Module:
    """The token embedding (or an untied lm_head): vocab-parallel, or `GGUFEmbedding`."""
    if is_gguf_quantized(config):
        _check_one_rank(tp)
        return GGUFEmbedding(config.vocab_size, config.hidden_size, _activation_dtype(config))
    from engine.models.tp_layers import VocabParallelEmbedding

    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)


def vocab_logits(
    hidden: torch.Tensor, head: nn.Module, vocab_size: int, tp: SingleRank
) -> torch.Tensor:  # [N, hidden] -> [N, V] in the model's dtype
    if isinstance(head, GGUFEmbedding):
        return head.logits(hidden)
    from engine.models.tp_layers import vocab_parallel_logits

    return vocab_parallel_logits(hidden, head.weight, vocab_size, tp)
