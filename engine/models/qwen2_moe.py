"""Qwen2-MoE: Qwen2's attention (q/k/v biases as `qkv_bias` says) with sparse MoE blocks.

Layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step` (then a dense MLP of `intermediate_size`). A sparse block routes each token
to its top `num_experts_per_tok` of `num_experts` experts of `moe_intermediate_size` (softmax
in fp32, renormalised when `norm_topk_prob`), and adds a shared expert of
`shared_expert_intermediate_size`, scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from engine.attention.backend import AttentionBackend
from engine.distributed.group import SingleRank
from engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from engine.models.moe import MoEWeightsMixin, SparseMoeBlock, is_sparse_layer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def qwen_moe_block(config: PretrainedConfig, tp: SingleRank, shared: int = 0) -> SparseMoeBlock:
    """The sparse block of Qwen2-MoE (`shared` > 0: its shared expert) and Qwen3-MoE."""
    return SparseMoeBlock(
        config,
        tp,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        shared_intermediate_size=shared,
        expert_parallel=tp.expert_parallel,
    )


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def build_attention(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        tp: SingleRank,
    ) -> nn.Module:
        qkv_bias = bool(getattr(config, "qkv_bias", True))
        return LlamaAttention(config, layer_idx, attn_backend, tp, qkv_bias=qkv_bias, o_bias=False)

    def build_mlp(self, config: PretrainedConfig, layer_idx: int, tp: SingleRank) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, tp)
        return qwen_moe_block(config, tp, config.shared_expert_intermediate_size)


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    model_cls = Qwen2MoeModel
