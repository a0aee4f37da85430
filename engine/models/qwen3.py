"""Qwen3 (dense) and Qwen3-MoE: Llama-style attention with an RMSNorm over each head's q and k
(`q_norm`, `k_norm`, weights [head_dim]) before the rotary embedding; `attention_bias` biases
q/k/v and o alike. Qwen3-MoE's sparse blocks are Qwen2-MoE's without the shared expert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.distributed.group import SingleRank
from engine.models.layers import RMSNorm
from engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from engine.models.moe import MoEWeightsMixin, is_sparse_layer
from engine.models.qwen2_moe import qwen_moe_block

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        tp: SingleRank,
    ) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, attn_backend, tp, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def heads_qk(
        self, q: torch.Tensor, k: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Split into heads, then RMSNorm each head of q and of k (before the rotary)."""
        d = self.head_dim
        return (self.q_norm(q.reshape(-1, d)).view(num_tokens, self.num_heads, d),
                self.k_norm(k.reshape(-1, d)).view(num_tokens, self.num_kv_heads, d))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def build_attention(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        tp: SingleRank,
    ) -> nn.Module:
        return Qwen3Attention(config, layer_idx, attn_backend, tp)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, config: PretrainedConfig, layer_idx: int, tp: SingleRank) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, tp)
        return qwen_moe_block(config, tp)


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model


class Qwen3MoeForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    model_cls = Qwen3MoeModel

    def __init__(self, config: PretrainedConfig, *args, **kwargs) -> None:
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError("sliding-window attention is not supported")
        super().__init__(config, *args, **kwargs)
