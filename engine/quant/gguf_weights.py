"""A GGUF file's weights, HF-named and kept quantized (what `iter_weights` is for safetensors).

Names follow transformers' GGUF loader for the Llama family (token_embd -> embed_tokens,
blk.N.attn_q -> layers.N.self_attn.q_proj, ...). llama.cpp's converter permutes the rows of a
llama model's q and k projections (rotary halves interleaved per head); transformers undoes it
(`LlamaTensorProcessor._reverse_permute_weights`), and so do we, on whole rows of blocks:

    GGUF row  h * 2 * dim + i * 2 + a   ->   HF row  h * 2 * dim + a * dim + i
    (head h, rotary half a in {0, 1}, i < dim = head_dim / 2)
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.quant.blocks import DENSE, SUPPORTED, QuantWeight, unpack
from engine.quant.ggml_types import GGMLQuantizationType as Q
from engine.quant.gguf_file import GGUFTensor, read_tensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_IGNORED = ("rope_freqs.weight",)  # llama3 rope scaling factors: the HF config carries them


def hf_name(gguf_name: str) -> str:
    """The transformers parameter name of a GGUF tensor; ValueError when it has none."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m is None or m.group(2) not in _PER_LAYER:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama-family parameter")
    return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"


def unsupported_tensors(path: str | Path) -> list[str]:
    """What pdserve cannot keep quantized (empty: all of it can): 'name (TYPE)' of each tensor of
    another format, then 'blk.N.kind.weight (no Llama-family layer)' once per kind of tensor
    without a dense Llama-family parameter (a mixture of experts' router and experts)."""
    tensors = [t for t in read_tensors(path) if t.name not in _IGNORED]
    bad = [f"{t.name} ({t.qtype.name})" for t in tensors if t.qtype not in (*SUPPORTED, *DENSE)]
    kinds = {_LAYER_NAME.sub(r"blk.N.\2.\3", t.name) for t in tensors if not _has_hf_name(t.name)}
    return bad + [f"{kind} (no Llama-family layer)" for kind in sorted(kinds)]


def _has_hf_name(gguf_name: str) -> bool:
    try:
        hf_name(gguf_name)
    except ValueError:
        return False
    return True


def iter_gguf_weights(
    path: str | Path, config: PretrainedConfig
) -> Iterator[tuple[str, QuantWeight | torch.Tensor]]:
    """Yield (HF name, weight) for every tensor: a `QuantWeight` for block formats, an fp32
    tensor for F32/F16/BF16. ValueError names the tensor and its type when the format is not
    supported. Nothing is de-quantized."""
    permute = config.model_type == "llama"
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for tensor in read_tensors(path):
        if tensor.name in _IGNORED:
            continue
        name = hf_name(tensor.name)
        weight = _load(tensor, name)
        proj = name.split(".")[-2]
        if permute and proj in heads and name.endswith(".weight"):
            weight = _rows(weight, _unpermute_index(weight.shape[0], heads[proj]))
        yield name, weight
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Hand the unpacking's freed temporaries back to the OS (glibc keeps ~85 MiB of them on
    its heap for the bundled model: its mmap threshold grows as large blocks are freed)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load(tensor: GGUFTensor, name: str) -> QuantWeight | torch.Tensor:
    if tensor.qtype in DENSE:  # widened exactly (bf16 is fp32's upper half) by numpy: gguf's
        # dequantize would import the whole gguf package (engine/quant/ggml_types.py)
        raw = np.asarray(tensor.data)
        if tensor.qtype == Q.BF16:
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view(np.float16 if tensor.qtype == Q.F16 else np.float32)
        return torch.from_numpy(values.astype(np.float32).reshape(tensor.shape))
    return unpack(tensor.qtype, tensor.data, tensor.shape, f"{tensor.name} ({name})")


def _unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """HF row r holds GGUF row index[r] (see the module docstring)."""
    dim = rows // num_heads // 2
    return torch.arange(rows).view(num_heads, dim, 2).transpose(1, 2).reshape(-1)


def _rows(w: QuantWeight | torch.Tensor, index: torch.Tensor) -> QuantWeight | torch.Tensor:
    return w[index] if isinstance(w, torch.Tensor) else w.rows(index)
