"""Block copies between two paged pools as few (address, length) descriptors as possible.

A pool is one tensor [L, 2, N, block_size, Hkv, D]: the K (or V) of one block in one layer is
`half = block_size * Hkv * D * elem` contiguous bytes at

    base + ((layer * 2 + kv) * N + block) * half

so a run of blocks consecutive on BOTH sides (src 7, 8, 9 -> dst 20, 21, 22) is one descriptor
per layer and K/V instead of one per block. Descriptor posting cost more than the bytes with
one per block per layer (vllm#55434); pools allocated from free lists give long runs.
"""

from __future__ import annotations

import numpy as np


def block_runs(src_ids: list[int], dst_ids: list[int]) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]:
    """Maximal runs where both id lists step by +1: (src starts, dst starts, lengths)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths


def run_descriptors(base: int, num_blocks: int, half: int, layers: tuple[int, int],
                    starts: np.ndarray, lengths: np.ndarray, device_id: int = 0) -> np.ndarray:
    """[n, 3] uint64 (address, bytes, device id): every run of `starts`/`lengths` for each layer
    of [l0, l1) and for K and V, in the order (layer, kv, run) on both sides of a copy."""
    l0, l1 = layers
    planes = np.arange(2 * l0, 2 * l1, dtype=np.int64)  # layer * 2 + kv
    addr = base + ((planes[:, None] * num_blocks + starts[None, :]) * half)
    size = np.broadcast_to(lengths[None, :] * half, addr.shape)
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = size.reshape(-1)
    out[:, 2] = device_id
    return out
