"""Mixtral: Mistral's attention with a sparse MoE block in place of the MLP.

Every layer routes each token to its top `num_experts_per_tok` of `num_local_experts` experts
(softmax over all experts in fp32, the top k renormalised to sum to 1; the weights stay fp32, as
in transformers). HF checkpoints name the block `block_sparse_moe` and the experts' gate / down /
up projections `w1` / `w2` / `w3`; here the block is `mlp` (engine/models/moe.py loads them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from engine.distributed.group import SingleRank
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from engine.models.moe import MoEWeightsMixin, SparseMoeBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: PretrainedConfig, layer_idx: int, tp: SingleRank) -> nn.Module:
        return SparseMoeBlock(
            config,
            tp,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            fp32_weights=True,
            expert_parallel=tp.expert_parallel,
        )


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    model_cls = MixtralModel
    HF_RENAMES = ((".block_sparse_moe.", ".mlp."),)
