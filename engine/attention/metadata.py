"""The per-step batch layout every attention backend reads.

The model runner builds one `AttentionMetadata` per step, before the forward pass; every layer
reuses it. Sequences are ordered prefills first (more than one new token), then decodes (exactly
one new token: a generated token, or the last prompt token after a prefix-cache hit):

    new tokens  |  seq0 chunk (q0 tokens)  |  seq1 chunk  | ... | dec0 | dec1 | ...
    query_start_loc = [0, q0, q0+q1, ..., T]
    seq_lens[i]     = tokens of seq i in the cache after this step (earlier context + new)

Token t of sequence i sits at position `seq_lens[i] - q_i + t`; its K/V goes to cache slot
`slot_mapping[...] = block_tables[i][pos // block_size] * block_size + pos % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    num_prefills: int  # sequences with more than one new token, first in the batch
    num_prefill_tokens: int  # their new tokens, first in the packed token axis
    num_decodes: int  # sequences with exactly one new token, after the prefills
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [S+1] int32 on device: new-token offsets per sequence
    seq_lens: torch.Tensor  # [S] int32 on device: context length after this step
    block_tables: torch.Tensor  # [S, max_blocks] int32 on device, padded with 0
    query_start_loc_cpu: list[int]  # the same offsets as Python ints (per-sequence loops)
    seq_lens_cpu: list[int]
    max_seq_len: int
    block_size: int
    # Backend-owned per-step precomputation (gather indices, masks), built once by
    # `AttentionBackend.prepare` and reused by every layer.
    backend_state: Any = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
