"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, in plain PyTorch.

The batch is packed: `input_ids` holds the new tokens of every sequence, one after the other,
with no padding; the attention backend uses `AttentionMetadata` to find each sequence's context
in the paged cache. q/k/v and gate/up are fused projections; `load_weights` maps HF names into
their slices. Numerics follow transformers' Llama (same op order) so fp32 logits match HF.

With tensor parallelism (`tp`, engine/distributed/) each rank builds the same model over its
shard: its attention heads (qkv column-parallel, o_proj row-parallel), its rows of the MLP
(gate_up column-parallel, down_proj row-parallel) and of the vocabulary (engine/models/
tp_layers.py). Norms, rotary tables and the residual stream are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.distributed.group import SingleRank
from engine.distributed.sharding import even_split, head_shard
from engine.models.cpu_decode_layer import fused_decode_layer
from engine.models.fused_qkv_rope import rmsnorm_qkv_rope
from engine.models.layers import RMSNorm, silu_and_mul
from engine.models.rotary import RopeInputs, RotaryEmbedding, rope_parameters
from engine.models.tp_layers import (
    WeightLoader,
    copy_rows,
    rmsnorm_linear,
    rmsnorm_swiglu_linear,
    silu_mul_linear,
    slice_loader,
)
from engine.quant.factories import linear, row_parallel_linear, vocab_embedding, vocab_logits

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# HF checkpoint name piece -> (our fused parameter name piece, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def qkv_has_bias(config: PretrainedConfig) -> bool:
    """Qwen2 always biases q/k/v; Llama does when `attention_bias` is set; Mistral never."""
    return config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))


class LlamaAttention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend,
        tp: SingleRank, *, qkv_bias: bool | None = None, o_bias: bool | None = None,
        scale: float | None = None,
    ) -> None:
        """`qkv_bias`, `o_bias`, `scale` override what `config` implies (other families)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend
        heads = head_shard(config.num_attention_heads, config.num_key_value_heads,
                           tp.world_size, tp.rank)
        self.head_dim = d = head_dim_of(config)
        self.num_heads = len(heads.q_heads)  # this rank's
        self.num_kv_heads = len(heads.kv_heads)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = d**-0.5 if scale is None else scale
        sharded = tp.world_size > 1
        q_rows = range(heads.q_heads.start * d, heads.q_heads.stop * d)
        kv_rows = range(heads.kv_heads.start * d, heads.kv_heads.stop * d)
        full_q, full_kv = config.num_attention_heads * d, config.num_key_value_heads * d
        # rows of each HF projection this rank holds, out of how many (also LoRA's slices)
        self.shard_rows = {"q": (q_rows, full_q), "k": (kv_rows, full_kv),
                           "v": (kv_rows, full_kv)}
        self._sources = {
            "q": slice_loader(0, q_rows if sharded else None, full_q),
            "k": slice_loader(0, kv_rows if sharded else None, full_kv),
            "v": slice_loader(0, kv_rows if sharded else None, full_kv),
        }
        if o_bias is None:
            o_bias = config.model_type == "llama" and bool(getattr(config, "attention_bias", False))
        if qkv_bias is None:
            qkv_bias = qkv_has_bias(config)
        self.qkv_proj = linear(config, config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = row_parallel_linear(config, full_q, config.hidden_size, q_rows, o_bias, tp)
        # q/k go from the projection straight to the rotary (no per-head norms between): the
        # decode GEMV may rotate and store them itself (engine/models/fused_qkv_rope.py)
        self.rope_fusable = (type(self).heads_qk is LlamaAttention.heads_qk
                             and type(self).forward is LlamaAttention.forward)

    def shard_slices(self) -> dict[str, slice]:
        """Rows of `qkv_proj` holding each of the HF q/k/v projections (this rank's heads)."""
        q, kv = self.q_size, self.kv_size
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}

    def shard_loader(self, shard: str) -> WeightLoader:
        return self._sources[shard]

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RopeInputs,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        qkv: torch.Tensor | None = None,  # [T, q_size + 2 * kv_size]: qkv_proj's, if made
        stored: bool = False,
    ) -> torch.Tensor:  # [T, hidden]
        """Attention of the new tokens; writes their K/V into `kv_cache` (via the backend).
        `qkv` given (the caller fused the projection with the norm before it): x is unused.
        `stored`: `qkv`'s q is rotated and its k/v are in the cache already
        (engine/models/fused_qkv_rope.py): the backend only attends."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x) if qkv is None else qkv
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.heads_qk(q, k, num_tokens)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # the backend rotates q/k (fused with the KV store where it can), stores, attends
        if stored:
            out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale, rope,
                                            stored=True)
        else:
            out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale, rope)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def heads_qk(
        self, q: torch.Tensor, k: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H, D], [T, Hkv, D]
        """q [T, q_size] and k [T, kv_size] split into heads (Qwen3 also norms each head)."""
        return (q.view(num_tokens, self.num_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(
        self, config: PretrainedConfig, tp: SingleRank, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        full = config.intermediate_size if intermediate_size is None else intermediate_size
        rows = even_split(full, tp.world_size, tp.rank)  # this rank's intermediate rows
        self.intermediate_size = len(rows)
        self.shard_rows = {"gate": (rows, full), "up": (rows, full)}  # (also LoRA's slices)
        self._source = slice_loader(0, rows if tp.world_size > 1 else None, full)
        self.gate_up_proj = linear(config, config.hidden_size, 2 * len(rows), bias)
        self.down_proj = row_parallel_linear(config, full, config.hidden_size, rows, bias, tp)

    def shard_slices(self) -> dict[str, slice]:
        """Rows of `gate_up_proj` holding the HF gate and up projections (this rank's rows)."""
        size = self.intermediate_size
        return {"gate": slice(0, size), "up": slice(size, 2 * size)}

    def shard_loader(self, shard: str) -> WeightLoader:
        return self._source

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down(self.gate_up_proj(x))

    def normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # (MLP output, x + residual)
        """self(norm(x + residual)) with the norm (and SwiGLU) inside the gate_up GEMV, where
        the load planned it (decode sizes, CUDA: engine/models/gemv_plan.py), or the norm
        quantizing its rows for an FP8 gate_up (tp_layers.rmsnorm_linear); None elsewhere."""
        gate_up = self.gate_up_proj
        fused = rmsnorm_swiglu_linear(x, residual, norm, gate_up)
        if fused is not None:  # (activations [T, I], residual)
            return self.down_proj(fused[0]), fused[1]
        fused = rmsnorm_linear(x, residual, norm, gate_up)
        return None if fused is None else (self.down(fused[0]), fused[1])

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, hidden]
        """down_proj(silu(gate) * up): one GEMV at decode sizes on CUDA where planned; SwiGLU
        quantizing its rows for an FP8 down_proj (tp_layers.silu_mul_linear)."""
        down = self.down_proj  # submodules once each: an nn.Module lookup costs ~0.5 us
        fused = silu_mul_linear(gate_up, down)
        return fused if fused is not None else down(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend,
        tp: SingleRank,
    ) -> None:
        super().__init__()
        self.self_attn = self.build_attention(config, layer_idx, attn_backend, tp)
        self.mlp = self.build_mlp(config, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_attention(
        self, config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend,
        tp: SingleRank,
    ) -> nn.Module:
        """The attention sublayer (other families override: biases, q/k norms, scale)."""
        return LlamaAttention(config, layer_idx, attn_backend, tp)

    def build_mlp(self, config: PretrainedConfig, layer_idx: int, tp: SingleRank) -> nn.Module:
        """The MLP sublayer (MoE families override it with their sparse blocks)."""
        return LlamaMLP(config, tp)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before it; None at layer 0
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), both [T, hidden]
        """HF's `residual + sublayer(norm(residual))` twice, with each skip-connection add
        deferred into the next norm (one fused kernel on CUDA; at decode sizes, where the load
        planned it, fused into the projection after the norm: engine/models/gemv_plan.py; on
        the CPU, a step of decodes through a quantized layer: one C call,
        engine/models/cpu_decode_layer.py)."""
        if not h.is_cuda:
            fused = fused_decode_layer(self, h, residual, rope, kv_cache, meta)
            if fused is not None:
                return fused
        x, residual = self._attention(h, residual, rope, kv_cache, meta)
        mlp, norm = self.mlp, self.post_attention_layernorm  # once each (~0.5 us a lookup)
        if isinstance(mlp, LlamaMLP):
            fused = mlp.normed(x, residual, norm)
            if fused is not None:
                return fused
        x, residual = norm(x, residual)
        return mlp(x), residual

    def _attention(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
        kv_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (attention output, residual stream)
        attn, norm = self.self_attn, self.input_layernorm
        fused = rmsnorm_qkv_rope(h, residual, norm, attn, rope, kv_cache, meta)
        if fused is not None:  # (qkv, residual): q rotated, k/v in the cache
            return attn(h, rope, kv_cache, meta, qkv=fused[0], stored=True), fused[1]
        fused = rmsnorm_linear(h, residual, norm, getattr(attn, "qkv_proj", None))
        if fused is not None:  # (qkv, residual)
            return attn(h, rope, kv_cache, meta, qkv=fused[0]), fused[1]
        if residual is None:
            x, residual = norm(h), h
        else:
            x, residual = norm(h, residual)
        return attn(x, rope, kv_cache, meta), residual


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self, config: PretrainedConfig, attn_backend: AttentionBackend, tp: SingleRank
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config, tp)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, attn_backend, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), rope_parameters(config),
            max_positions=getattr(config, "max_position_embeddings", 0),
            kernel_inputs=attn_backend.name == "triton",
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb.inputs(positions, h.dtype)  # shared by every layer
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, residual = layer(h, residual, rope, kv_cache, meta)
            if on_layer is not None:
                on_layer(i + 1)  # layers [0, i + 1) hold this step's K/V (queued, on CUDA)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM over packed tokens and a paged KV cache (one cache tensor per layer)."""

    model_cls: type[LlamaModel] = LlamaModel  # other families subclass both

    def __init__(
        self, config: PretrainedConfig, attn_backend: AttentionBackend,
        tp: SingleRank | None = None,
    ) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        self.config = config
        self.tp = tp = tp or SingleRank()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = self.model_cls(config, attn_backend, tp)
        # lm_head: this rank's rows of the vocabulary, like the embedding (which it may be)
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else vocab_embedding(config, tp)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, packed new tokens of all sequences
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, head_dim]
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """Hidden states of the new tokens. Side effect: writes their K/V into `kv_caches`.
        `on_layer(n)`, if given, is called once layers [0, n) are done (prefill role: the KV
        sender ships their blocks while later layers compute)."""
        return self.model(input_ids, positions, kv_caches, meta, on_layer)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, hidden] -> [N, V] logits, in fp32 (`upcast`) or the model's dtype. With tensor
        parallelism every rank calls it with the same rows; rank 0 gets the logits."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = vocab_logits(hidden, head, self.config.vocab_size, self.tp)
        return logits.float() if upcast else logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters (fusing q/k/v and gate/up), casting to each
        parameter's dtype. Raises ValueError on an unknown name, a shape mismatch, or any
        parameter (or fused shard) left unloaded. A tied lm_head.weight is skipped."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | None]] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            name, shard = _fused_name(hf_name)
            if name not in params:
                raise ValueError(f"unknown weight {hf_name!r} for {type(self).__name__}")
            param = params[name]
            load = self._loader(name, shard, param)
            load(param, self._shard_rows(name, shard), tensor, hf_name)
            loaded.add((name, shard))
        self._check_all_loaded(params, loaded)

    def _loader(self, name: str, shard: str | None, param: nn.Parameter) -> WeightLoader:
        """What copies this rank's part of an HF tensor into `param` (tp_layers.py)."""
        if shard is None or getattr(param, "loads_shards", False):  # quantized: all rows
            return getattr(param, "weight_loader", copy_rows)
        return self.get_submodule(name.rsplit(".", 2)[0]).shard_loader(shard)

    def _shard_rows(self, name: str, shard: str | None) -> slice:
        """Rows of parameter `name` that HF shard `shard` fills (all rows when unfused)."""
        if shard is None:
            return slice(None)
        module = self.get_submodule(name.rsplit(".", 2)[0])  # ...self_attn / ...mlp
        return module.shard_slices()[shard]

    def _check_all_loaded(
        self, params: dict[str, nn.Parameter], loaded: set[tuple[str, str | None]]
    ) -> None:
        missing = []
        for name in params:
            shards = _expected_shards(name)
            missing += [f"{name}[{s}]" if s else name for s in shards if (name, s) not in loaded]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing}")


def _fused_name(hf_name: str) -> tuple[str, str | None]:
    """HF parameter name -> (our parameter name, shard id or None when not fused)."""
    for hf_piece, fused_piece, shard in STACKED_PARAMS:
        if hf_piece in hf_name:
            return hf_name.replace(hf_piece, fused_piece), shard
    return hf_name, None


def _expected_shards(name: str) -> tuple[str | None, ...]:
    if ".qkv_proj." in name:
        return ("q", "k", "v")
    if ".gate_up_proj." in name:
        return ("gate", "up")
    return (None,)
