"""Where a Llama decoder layer runs as one C call (kernels/cpu_decode_layer.py): on the CPU, for a
step of decodes only, fp32 rows, when the layer is the plain one the kernel computes.

A layer qualifies once, at its first step: LlamaAttention and LlamaMLP as they are (no q/k norms,
no biases, no LoRA wrappers: those are other types), the decoder layer's own attention step,
every projection a GGUFLinear held by one NibbleKernel, both norms RMSNorm with fp32 weights, the
torch attention backend. A step then qualifies when the torch backend planned it as decodes
only, its rotary tables are fp32, the rows fp32, fewer than DENSE_MIN_TOKENS, and the cache fp32
within the attention kernel's limits.
Anything else returns None and the layer's modules run as before; the two compute the same
kernels in the same order (tests/test_cpu_decode_layer.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.metadata import AttentionMetadata
from engine.models.layers import RMSNorm
from engine.models.rotary import RopeInputs
from engine.quant.int4_dense import DENSE_MIN_TOKENS
from engine.quant.layers import GGUFLinear
from kernels import cpu_attention, cpu_decode_layer

_NOT_FUSED = "not fused"  # a layer's plan once it is known not to qualify


def fused_decode_layer(
    layer: Any, h: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs | None,
    kv_cache: torch.Tensor, meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (MLP output, residual stream), or None
    """The layer's (out, residual) from one C call where the layer and the step qualify (the
    module's note); None elsewhere (nothing computed, nothing written)."""
    plan = layer.__dict__.get("_cpu_decode_plan")
    if plan is None:
        plan = layer.__dict__["_cpu_decode_plan"] = _plan(layer) or _NOT_FUSED
    if plan is _NOT_FUSED:
        return None
    state = meta.backend_state
    if (
        not getattr(state, "decode_only", False)  # the torch backend's plan of the step
        or rope is None or rope.cos is None or rope.cos.dtype != torch.float32
        or h.dtype != torch.float32 or h.dim() != 2 or h.stride(1) != 1
        or h.shape[0] >= DENSE_MIN_TOKENS
        or (residual is not None and (residual.dtype != torch.float32
                                      or residual.stride(1) != 1))
        or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous()
        or kv_cache.shape[2] > cpu_attention.MAX_BLOCK_SIZE
    ):
        return None
    step = state.memo.get(("c_layer", id(rope)), lambda: cpu_decode_layer.StepArgs(
        cpu_attention.StepArgs(meta.slot_mapping, meta.block_tables, meta.seq_lens, rope.cos,
                               rope.sin)))
    return cpu_decode_layer.run(plan, step, kv_cache, h, residual)


def _plan(layer: Any) -> cpu_decode_layer.LayerArgs | None:
    from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    attn, mlp = layer.self_attn, layer.mlp
    if (
        cpu_decode_layer.library() is None
        or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP
        or type(layer)._attention is not LlamaDecoderLayer._attention
        or attn.attn_backend.name != "torch"
        or attn.head_dim > cpu_attention.MAX_HEAD_DIM or attn.head_dim % 2
        or attn.num_heads // attn.num_kv_heads > cpu_attention.MAX_GROUP
    ):
        return None
    gemms = [_gemm(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(g is None for g in gemms) or any(
            type(n) is not RMSNorm or n.weight.dtype != torch.float32
            or not n.weight.is_contiguous() for n in norms):
        return None
    return cpu_decode_layer.LayerArgs(
        *gemms, norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps, attn.num_heads,
        attn.num_kv_heads, attn.head_dim, attn.scale)


def _gemm(proj: Any) -> Any:
    """The nibble GEMM holding a whole projection with no bias, else None."""
    if type(proj) is not GGUFLinear or proj.bias is not None:
        return None
    return proj.nibble_gemm
