"""Every rank's KV cache seen from rank 0 as one cache of all KV heads.

A disaggregated worker with tensor parallelism moves KV through rank 0 (its gRPC service lives
there), while each rank holds only its heads. The other ranks hand rank 0 their KV pool once at
start (a tensor in shared memory on the CPU, a CUDA IPC mapping on a GPU: no copy), so rank 0
reads a push's blocks from every rank's pool and writes a received push's heads into each owner:

    push slab [2, blocks, bs, H, D]        heads [0, h0) [h0, h1) ...
                                              |        |
    rank pools [L, 2, N, bs, H_r, D]       rank 0   rank 1   ...   (a replicated KV head is read
                                                                    from its first owner and
                                                                    written to every owner)

Ordering: rank r writes a layer's K/V before that layer's all-reduce, which rank 0 finishes only
after rank r joined it, so the KV progress events of rank 0's stream cover every rank's writes.
"""

from __future__ import annotations

import torch

from kernels.kv_cache_fp8 import as_bytes, index_copy_kv


class ShardedKVLayer:
    """One layer of every rank's cache: `shape` [2, num_blocks, block_size, H, D] of all heads."""

    def __init__(self, layers: list[torch.Tensor], heads: list[range]) -> None:
        self.layers, self.heads = layers, heads  # per rank: [2, N, bs, H_r, D], its KV heads
        two, n, bs, _, d = layers[0].shape
        self.shape = torch.Size((two, n, bs, max(h.stop for h in heads), d))
        self.dtype, self.device = layers[0].dtype, layers[0].device
        seen: set[int] = set()
        self._readers = []  # (rank, heads) that own a head first
        for rank, h in enumerate(heads):
            if h.start not in seen:
                self._readers.append((rank, h))
            seen.update(h)

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out [2, len(ids), bs, H, D] <- the blocks `ids` of every head."""
        for rank, h in self._readers:
            cache = self.layers[rank]
            _follow(cache.device, out.device)
            part = as_bytes(cache).index_select(1, ids.to(cache.device))
            as_bytes(out)[:, :, :, h.start:h.stop].copy_(part)

    def write(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        """Blocks `ids` of every owner <- their heads of src [2, len(ids), bs, H, D]."""
        for cache, h in zip(self.layers, self.heads, strict=True):
            _follow(cache.device, src.device)
            index_copy_kv(cache, 1, ids.to(cache.device), src[:, :, :, h.start:h.stop]
                          .to(cache.device))
            if cache.device.type == "cuda" and cache.device != src.device:
                # the owner's process runs on streams of its own: done before the commit
                torch.cuda.synchronize(cache.device)


def sharded_layers(pools: list[torch.Tensor], heads: list[range]) -> list[ShardedKVLayer]:
    """Per layer, the sharded view of every rank's pool [L, 2, N, bs, H_r, D]."""
    return [ShardedKVLayer([p[layer] for p in pools], heads) for layer in range(len(pools[0]))]


def _follow(device: torch.device, leader: torch.device) -> None:
    """Make `device`'s current stream wait for `leader`'s (CUDA, another device)."""
    if device.type == "cuda" and device != leader:
        torch.cuda.current_stream(device).wait_stream(torch.cuda.current_stream(leader))
