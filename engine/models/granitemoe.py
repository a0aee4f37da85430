"""GraniteMoE (IBM's PowerMoE): Mixtral's shape with four scalar multipliers.

    h = embed(ids) * embedding_multiplier
    h = h + attn(norm(h)) * residual_multiplier       attention scale: attention_multiplier
    h = h + moe(norm(h)) * residual_multiplier
    logits = lm_head(norm(h)) / logits_scaling

The router takes the top k logits and a softmax over those k only (transformers'
GraniteMoeTopKRouter). HF checkpoints hold each layer's experts fused:
`block_sparse_moe.input_linear.weight [E, 2I, H]` (gate rows, then up rows) and
`block_sparse_moe.output_linear.weight [E, H, I]`, with the router at
`block_sparse_moe.router.layer.weight`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.distributed.group import SingleRank
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from engine.models.moe import MoEWeightsMixin, SparseMoeBlock
from engine.models.tp_layers import VocabParallelEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GraniteMoeAttention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, *args, **kwargs) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(
            config, *args, qkv_bias=bias, o_bias=bias, scale=config.attention_multiplier, **kwargs
        )
        self.residual_multiplier = config.residual_multiplier

    def forward(self, *args, **kwargs) -> torch.Tensor:  # [T, hidden]
        return super().forward(*args, **kwargs) * self.residual_multiplier


class GraniteMoeBlock(SparseMoeBlock):
    def __init__(self, config: PretrainedConfig, tp: SingleRank) -> None:
        super().__init__(
            config,
            tp,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            routing="topk_softmax",
            expert_parallel=tp.expert_parallel,
        )
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return super().forward(x) * self.residual_multiplier


class GraniteMoeDecoderLayer(LlamaDecoderLayer):
    def build_attention(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        tp: SingleRank,
    ) -> nn.Module:
        return GraniteMoeAttention(config, layer_idx, attn_backend, tp)

    def build_mlp(self, config: PretrainedConfig, layer_idx: int, tp: SingleRank) -> nn.Module:
        return GraniteMoeBlock(config, tp)


class ScaledEmbedding(VocabParallelEmbedding):
    """The embedding lookup times `multiplier` (the weight itself is unscaled: a tied lm_head
    reads it as is)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: SingleRank, multiplier: float):
        super().__init__(vocab_size, hidden_size, tp)
        self.multiplier = multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return super().forward(ids) * self.multiplier


class GraniteMoeModel(LlamaModel):
    layer_cls = GraniteMoeDecoderLayer

    def __init__(self, config: PretrainedConfig, attn_backend: AttentionBackend, tp: SingleRank):
        super().__init__(config, attn_backend, tp)
        self.embed_tokens = ScaledEmbedding(
            config.vocab_size, config.hidden_size, tp, config.embedding_multiplier
        )


class GraniteMoeForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    model_cls = GraniteMoeModel
    HF_RENAMES = (
        (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
        (".block_sparse_moe.router.layer.", ".mlp.gate."),
        (".block_sparse_moe.router.", ".mlp.gate."),
        (".block_sparse_moe.", ".mlp."),
    )

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Llama's logits divided by `logits_scaling` (in the model's dtype, as HF does)."""
        logits = super().compute_logits(hidden, upcast=False) / self.config.logits_scaling
        return logits.float() if upcast else logits
