"""The seam between the model and the attention implementation (torch_backend.py: pure torch,
CPU and GPU; triton_backend.py: pdserve's Triton kernels, the default on CUDA).

A backend stores the step's new K/V into the paged cache and computes causal attention of the new
queries over each sequence's whole context (earlier tokens already in the cache plus the new
ones). Cache layout per layer: `kv_cache[0]` is K, `kv_cache[1]` is V, each
`[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.models.rotary import RopeInputs


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step state into `meta.backend_state`; called once before the forward."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Rotate q and k by `rope` (None: they already are), write k/v into `kv_cache` at
        `meta.slot_mapping`, then attend. Mutates `kv_cache`, and q and k when it rotates them
        in place. The rotation is the backend's so that it can fuse it with the store."""
        ...
