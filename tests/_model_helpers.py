"""Shared helpers for the model, attention-backend and loader tests: batch metadata over shuffled
block tables, zeroed KV caches, a naive attention reference, and a tiny GGUF file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step: `num_cached` tokens already in the cache, `num_new` now."""

    block_ids: list[int]
    num_cached: int
    num_new: int

    @property
    def seq_len(self) -> int:
        return self.num_cached + self.num_new


def shuffled_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, seed: int
) -> list[list[int]]:
    """Disjoint, non-contiguous block ids for sequences of the given final lengths."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for seq_len in seq_lens:
        count = math.ceil(seq_len / block_size)
        tables.append(perm[:count])
        perm = perm[count:]
    return tables


def build_metadata(
    chunks: list[SeqChunk], block_size: int, device: str = "cpu"
) -> AttentionMetadata:
    """The metadata the model runner would build for one step (prefills first, then decodes)."""
    is_decode = [c.num_new == 1 for c in chunks]
    assert is_decode == sorted(is_decode), "prefills must come before decodes"
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.num_new)
    slots = [
        c.block_ids[pos // block_size] * block_size + pos % block_size
        for c in chunks
        for pos in range(c.num_cached, c.seq_len)
    ]
    max_blocks = max(len(c.block_ids) for c in chunks)
    tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]
    num_prefills = is_decode.count(False)
    return AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=starts[num_prefills],
        num_decodes=len(chunks) - num_prefills,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c.seq_len for c in chunks], dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[c.seq_len for c in chunks],
        max_seq_len=max(c.seq_len for c in chunks),
        block_size=block_size,
    )


def positions_of(chunks: list[SeqChunk]) -> torch.Tensor:  # [T] int64
    return torch.cat([torch.arange(c.num_cached, c.seq_len) for c in chunks])


def zero_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape) for _ in range(num_layers)]


def naive_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], new k/v already stored
    chunks: list[SeqChunk],
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Slow, obviously correct reference: per sequence, per query, plain softmax."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out, t = torch.empty_like(q), 0
    for c in chunks:
        slots = [
            c.block_ids[p // block_size] * block_size + p % block_size for p in range(c.seq_len)
        ]
        keys = kv_cache[0].flatten(0, 1)[slots]  # [seq_len, Hkv, D]
        values = kv_cache[1].flatten(0, 1)[slots]
        for pos in range(c.num_cached, c.seq_len):
            for h in range(q.shape[1]):
                scores = keys[: pos + 1, h // group] @ q[t, h] * scale  # [pos + 1]
                out[t, h] = scores.softmax(-1) @ values[: pos + 1, h // group]
            t += 1
    return out


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode alphabet (256 printable stand-ins, one per byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(extra))]


def write_tiny_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer llama GGUF (hidden 64, 4/2 heads, Q8_0 matrices) with a tiny BPE tokenizer."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    tokens = ["<|endoftext|>", *_gpt2_byte_chars(), "Ġt", "he"]
    hidden, inter, heads, kv_heads, layers = 64, 128, 4, 2, 2
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_rope_dimension_count(hidden // heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def add(name: str, shape: tuple[int, ...]) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2:
            q8 = GGMLQuantizationType.Q8_0
            w.add_tensor(name, quantize(data, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, data)

    kv = hidden // heads * kv_heads
    add("token_embd.weight", (len(tokens), hidden))
    for i in range(layers):
        for name, shape in [
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (inter, hidden)),
            ("ffn_up", (inter, hidden)),
            ("ffn_down", (hidden, inter)),
            ("attn_norm", (hidden,)),
            ("ffn_norm", (hidden,)),
        ]:
            add(f"blk.{i}.{name}.weight", shape)
    add("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
