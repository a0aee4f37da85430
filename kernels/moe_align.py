"""Align routed (token, k) pairs by expert for the fused MoE GEMMs, in one program and one launch
(vLLM's moe_align_block_size).

NOTE: the T*K pairs (pair = t * K + k) are sorted by expert, stably, and each expert's run is
padded to BLOCK_M, so every BLOCK_M tile of the sorted list belongs to one expert:

    topk_ids [T, K] = [[2, 0], [2, 1], [0, 2]]         pairs 0..5
    counts   = [2, 1, 3, 0]   padded = [4, 4, 4, 0]   ends = [4, 8, 12, 12]   (BLOCK_M 4)
    sorted_ids     = [1, 4, P, P | 3, P, P, P | 0, 2, 5, P | P ...]   P = T*K: padding
    tile_experts   = [0,          1,            2,          3 ...]    tiles past the end: E - 1
    num_padded     = 12

One program, three passes over the pairs in chunks of BLOCK (a one-hot [BLOCK, E] per chunk):
  1. counts per expert; their padded exclusive cumsum gives each expert's first slot
  2. fill sorted_ids with P and write tile_experts (a tile's expert = how many experts end at or
     before its first slot)
  3. (after a barrier) each pair goes to first[e] + (pairs of e in earlier chunks) + (its rank
     among e's pairs in this chunk, a cumsum down the one-hot)
Pairs whose id is outside [0, E) (another rank's experts) match no column and are left out.
The outputs are sized for the worst case from T*K alone, so the launch never syncs with the
host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [num_pairs] int32/int64 expert per pair
    sorted_ids_ptr,  # [num_slots] int32 out: pairs sorted by expert, padded with num_pairs
    tile_experts_ptr,  # [num_slots / BLOCK_M] int32 out
    num_padded_ptr,  # [1] int32 out
    num_pairs,
    num_experts,
    num_slots,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
):
    experts = tl.arange(0, EXPERTS_PAD)  # [E]
    local = experts < num_experts
    counts = tl.zeros([EXPERTS_PAD], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)  # [BLOCK]
        hit = (ids[:, None] == experts[None, :]) & local[None, :]  # [BLOCK, E]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E]; 0 past the experts
    first = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))

    fill = tl.full([BLOCK], 0, tl.int32) + num_pairs
    for start in range(0, num_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_ids_ptr + offs, fill, mask=offs < num_slots)
    num_tiles = num_slots // BLOCK_M
    for start in range(0, num_tiles, BLOCK):
        tiles = start + tl.arange(0, BLOCK)  # [BLOCK]
        before = (ends[None, :] <= tiles[:, None] * BLOCK_M) & local[None, :]  # [BLOCK, E]
        expert = tl.minimum(tl.sum(before.to(tl.int32), axis=1), num_experts - 1)
        tl.store(tile_experts_ptr + tiles, expert, mask=tiles < num_tiles)
    tl.debug_barrier()  # the padding fill lands before the pairs overwrite it

    seen = tl.zeros([EXPERTS_PAD], tl.int32)  # pairs of each expert in earlier chunks
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        hit = ((ids[:, None] == experts[None, :]) & local[None, :]).to(tl.int32)  # [BLOCK, E]
        rank = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1  # [BLOCK]; -1: left out
        base = tl.sum(hit * (first + seen)[None, :], axis=1)
        tl.store(sorted_ids_ptr + base + rank, offs.to(tl.int32), mask=rank >= 0)
        seen += tl.sum(hit, axis=0)


def num_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The worst-case padded length: every touched expert wastes up to BLOCK_M - 1 slots."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor,  # [T, K]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [S] int32, tile_experts [S / block_m] int32, num_padded [1] int32), S =
    num_slots(T*K, E, block_m) (see the module NOTE). One launch, no host sync."""
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K] int32/int64, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"need >= 1 expert and a power-of-2 block_m, got {num_experts}, "
                         f"{block_m}")
    pairs, device = topk_ids.numel(), topk_ids.device
    slots = num_slots(pairs, num_experts, block_m)
    out = torch.empty(slots + slots // block_m + 1, dtype=torch.int32, device=device)  # 1 alloc
    sorted_ids, tile_experts, num_padded = out.split([slots, slots // block_m, 1])
    experts_pad = max(16, triton.next_power_of_2(num_experts))
    block = max(16, min(4096 // experts_pad, triton.next_power_of_2(max(pairs, 1))))
    _moe_align_kernel[(1,)](
        topk_ids.contiguous(),
        sorted_ids,
        tile_experts,
        num_padded,
        pairs,
        num_experts,
        slots,
        BLOCK_M=block_m,
        BLOCK=block,
        EXPERTS_PAD=experts_pad,
        num_warps=4,
    )
    return sorted_ids, tile_experts, num_padded


def moe_align_ref(
    topk_ids: torch.Tensor,  # [T, K]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same layout from a stable sort, in plain torch (slow: many small ops)."""
    device, pairs = topk_ids.device, topk_ids.numel()
    flat = topk_ids.flatten().long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # E: left out
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    slots = num_slots(pairs, num_experts, block_m)
    sorted_ids = torch.full((slots,), pairs, dtype=torch.int32, device=device)
    for e in range(num_experts):
        (mine,) = torch.nonzero(key == e, as_tuple=True)
        start = int(ends[e] - padded[e])
        sorted_ids[start : start + mine.numel()] = mine.to(torch.int32)
    tile_start = torch.arange(0, slots, block_m, device=device)
    tile_experts = torch.searchsorted(ends, tile_start, right=True).clamp(max=num_experts - 1)
    total = ends[-1:].to(torch.int32)
    return sorted_ids, tile_experts.to(torch.int32), total
