"""An HF transformers model written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
writes it (test-side: tiny random models for the GGUF loaders' tests).

    config   -> `<arch>.*` metadata (llama.cpp's key names) + a tiny byte-level BPE tokenizer
    tensors  -> gguf's own HF -> GGUF name map (`blk.N.attn_q.weight`, ...), and for the experts
                transformers' stacked tensors split the way llama.cpp stacks them:
                  experts.gate_up_proj [E, 2I, H] -> ffn_gate_exps [E, I, H], ffn_up_exps [E, I, H]
                  experts.down_proj    [E, H, I]  -> ffn_down_exps [E, H, I]

Matrices are stored as `qtype` (Q8_0 by default) where their rows split into whole blocks, else
F16; vectors, the routers and F32 requests stay F32 (llama.cpp keeps them so). The llama
architecture's q/k rows are permuted as llama.cpp permutes them (rotary halves interleaved).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from _model_helpers import _gpt2_byte_chars
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    get_tensor_name_map,
)
from gguf.quants import quantize

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# transformers model_type -> llama.cpp architecture (Mixtral is llama with experts)
GGUF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen2_moe": "qwen2moe",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "granitemoe": "granitemoe",
}
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\w+)$")
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
_FILE_TYPES = {
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
}


def tiny_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges): <|endoftext|>, GPT-2's 256 byte characters and a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
    return ["<|endoftext|>", *_gpt2_byte_chars(), *(m.replace(" ", "") for m in merges)], merges


def write_gguf(
    model: PreTrainedModel,
    path: str | Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
) -> None:
    """Write `model` (its config's vocab_size must equal `len(tiny_vocab()[0])`) to `path`."""
    config = model.config
    arch = GGUF_ARCHS[config.model_type]
    tokens, merges = tiny_vocab()
    if config.vocab_size != len(tokens):
        raise ValueError(f"vocab_size {config.vocab_size}: the tiny vocab has {len(tokens)}")
    writer = GGUFWriter(str(path), arch)
    _add_config(writer, config)
    writer.add_file_type(_FILE_TYPES.get(qtype, LlamaFileType.GUESSED))
    _add_tokenizer(writer, tokens, merges)
    for name, tensor in _gguf_tensors(model, arch):
        _add_tensor(writer, name, tensor, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_config(w: GGUFWriter, c: PretrainedConfig) -> None:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_name(f"tiny-{c.model_type}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", c.intermediate_size))
    if getattr(c, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if c.model_type == "granitemoe":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)


def _add_tokenizer(w: GGUFWriter, tokens: list[str], merges: list[str]) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))  # 3: control
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _gguf_tensors(model: PreTrainedModel, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 array) for every parameter, a tied lm_head left out."""
    config = model.config
    names = get_tensor_name_map(_arch_enum(arch), config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().to(torch.float32).numpy()
        if m := _EXPERTS.match(hf_name):
            yield from _experts(int(m[1]), m[2], data)
            continue
        base, _, suffix = hf_name.rpartition(".")
        base = base.replace(".block_sparse_moe.router", ".block_sparse_moe.router.layer")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"{hf_name!r} has no GGUF name in architecture {arch}")
        name = f"{gguf_name}.{suffix}"
        if arch == "llama" and suffix == "weight" and gguf_name.endswith((".attn_q", ".attn_k")):
            heads = config.num_attention_heads
            data = _permute(data, heads if gguf_name.endswith("q") else config.num_key_value_heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # llama.cpp's shared-expert gate is a vector [H]
        yield name, data


def _experts(layer: int, part: str, data: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    if part == "down_proj":
        yield f"blk.{layer}.ffn_down_exps.weight", data
    elif part == "gate_up_proj":
        gate, up = np.split(data, 2, axis=1)
        yield f"blk.{layer}.ffn_gate_exps.weight", gate
        yield f"blk.{layer}.ffn_up_exps.weight", up
    else:
        raise ValueError(f"unknown expert tensor {part!r} in layer {layer}")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: per head, rows (half a, i) -> (i, half a)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _add_tensor(w: GGUFWriter, name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    if data.ndim == 1 or name.endswith(_ROUTERS) or qtype == GGMLQuantizationType.F32:
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif data.shape[-1] % block == 0:
        w.add_tensor(name, quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, data.astype(np.float16))


def _arch_enum(arch: str) -> MODEL_ARCH:
    return next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
