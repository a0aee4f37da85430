"""The attention's input side as one GEMV at decode sizes: the residual add and RMSNorm, the
q/k/v projection, the rotary embedding and the K/V cache store (kernels/gemv_rmsnorm_rope.py).

NOTE: where the load planned norm + q/k/v as one GEMV for the step's token count
(engine/models/gemv_plan.py, `gemv_norm_plan`), the Triton attention backend would then launch
kernels/rope_store.py to rotate q and k and store k and v. The fused kernel does both in the
GEMV's epilogue, on the same tile (its rows taken in rotary pairs), one launch a layer fewer;
the backend then attends only (`stored=True`). It applies where the rotation is the whole head
(the backend's cos|sin cache, `RopeInputs.cache`), the attention is Llama's own (no per-head
norms between projection and rotation: `LlamaAttention.rope_fusable`) and no adapter wraps
q/k/v. PDSERVE_FUSED_QKV_ROPE=0 turns it off (comparisons).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.lazy_kernels import kernel
from engine.models.rotary import RopeInputs
from engine.models.tp_layers import rmsnorm_gemv_plan

FUSED = os.environ.get("PDSERVE_FUSED_QKV_ROPE", "1") != "0"
gemv_rmsnorm_rope = kernel("gemv_rmsnorm_rope", "gemv_rmsnorm_rope")
gemv_rmsnorm_rope_supports = kernel("gemv_rmsnorm_rope", "gemv_rmsnorm_rope_supports")


def rmsnorm_qkv_rope(
    h: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, attn: nn.Module,
    rope: RopeInputs, kv_cache: torch.Tensor, meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qkv [T, N] with q rotated, h + residual), k and v stored into `kv_cache` at
    `meta.slot_mapping` (mutates it), where the NOTE's conditions hold; None elsewhere."""
    if not FUSED or not getattr(attn, "rope_fusable", False) or rope.cache is None:
        return None
    backend = attn.attn_backend
    if not getattr(backend, "stores_fused_rope", False):
        return None
    proj = attn.qkv_proj
    planned = rmsnorm_gemv_plan(h, residual, norm, proj)
    if planned is None or rope.cache.shape[1] != attn.head_dim:
        return None
    w, blocks, scale = planned
    k_cache = kv_cache[0]
    if not gemv_rmsnorm_rope_supports(h, residual, norm.weight, w, scale, k_cache,
                                      attn.num_heads, attn.num_kv_heads, attn.head_dim):
        return None
    return gemv_rmsnorm_rope(
        h, residual, norm.weight, norm.eps, w, proj.bias, blocks, scale,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, positions=rope.positions,
        cos_sin=rope.cache, k_cache=k_cache, v_cache=kv_cache[1],
        slot_mapping=meta.slot_mapping, k_scale=backend.k_scale, v_scale=backend.v_scale)
