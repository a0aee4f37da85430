"""Batched multi-LoRA (Punica's BGMV/SGMV): y[t] += B_s (A_s x[t]), s = slots[t], in place.

The public entry is lora_apply; its kernels live in kernels/lora_kernels.py (whose NOTE draws
both ways through): for one token (T <= FUSED_MAX_T) one fused launch that recomputes the
shrink per column chunk, above that a shrink with split-K fp32 partials then an expand.
Measured on an H100 in CUDA graphs (pdserve/bench/gpu_lora_kernels.py), at T = 1 the fused
launch takes 4.6-5.8 us against the pair's 5.3-6.7 (qkv, o, down; gate_up ties at 6.5). From
T = 8 with mixed slots the pair wins (fused: a serial shrink pass per slot in every chunk,
gate_up 9.9 us against 7.7), and for prefill the redundant shrink costs far more than a launch.
At decode sizes over a plain (not quantized) base the engine takes neither: its shrink rides in
the base GEMV and kernels/lora_fold.py expands (engine/lora/layers.py).

Grids depend on shapes alone and slots are read on the device: no host sync, CUDA-graph safe.
Without triton the module still imports and lora_apply falls back to lora_apply_ref, the torch
path the engine uses on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import INTERPRET, dot_precision
from kernels.lora_kernels import (
    MAX_SLICES,
    _lora_expand_kernel,
    _lora_fused_kernel,
    _lora_shrink_kernel,
    triton,
)

_NONE = 1 << 30  # first chunk of a missing slice: never reached


# ---- launchers ---------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_K, SPLIT_K, num_warps, num_stages)
ShrinkConfig = tuple[int, int, int, int, int]
# (BLOCK_M, BLOCK_N, CHUNK_BLOCKS, num_warps, num_stages)
ExpandConfig = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class LoRAConfig:
    """Tiles of a shrink-then-expand lora_apply; by_slot: a grid axis over the S slots (G = S),
    else G = 1."""

    shrink: ShrinkConfig
    expand: ExpandConfig
    by_slot: bool


@dataclass(frozen=True)
class FusedConfig:
    """Tiles of a one-launch lora_apply (_lora_fused_kernel); by_slot: a grid axis over the S
    slots (G = S), else G = 1."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    by_slot: bool = False
    num_warps: int = 4
    num_stages: int = 3


# tiny tiles keep the interpreter's numpy arrays small; every path is tested
INTERPRET_CONFIGS = {
    by_slot: LoRAConfig((16, 16, 2, 1, 1), (16, 16, 2, 1, 1), by_slot) for by_slot in (False, True)
}
INTERPRET_FUSED = {
    (split, by_slot): FusedConfig(16, 16, 16, split, by_slot, 1, 1)
    for split in (1, 2) for by_slot in (False, True)
}
FUSED_MAX_T = 1  # up to this many tokens one fused launch
BY_SLOT_MAX_T = 512  # up to this many tokens (the engine's decode batches) a grid axis per slot


def choose_config(num_tokens: int, in_features: int,
                  out_features: int) -> LoRAConfig | FusedConfig:
    """Tiles measured best on an H100 for a 1B Llama's projections (rank 16, 4 slots; tuned by
    `python -m pdserve.bench.gpu_lora_kernels --tune`): one fused launch up to FUSED_MAX_T
    tokens, 128 columns a program, K whole for a wide output (gate_up), else in 4 parts (8 for
    K > 2048); above, choose_two_pass's."""
    if num_tokens > FUSED_MAX_T:
        return choose_two_pass(num_tokens, in_features)
    if INTERPRET:
        return INTERPRET_FUSED[2, True]
    split = 1 if out_features > 4096 else 4 if in_features <= 2048 else 8
    return FusedConfig(16, 128, 256, split, False)


def choose_two_pass(num_tokens: int, in_features: int) -> LoRAConfig:
    """16-row shrink tiles up to 64 tokens with K split into ~256-wide parts, 64-row tiles
    above with ~512-wide parts, fewer splits once the token tiles alone fill the GPU; a grid
    axis per slot up to BY_SLOT_MAX_T tokens."""
    if INTERPRET:
        return INTERPRET_CONFIGS[num_tokens <= BY_SLOT_MAX_T]
    small = num_tokens <= 16
    block_m = 16 if num_tokens <= 64 else 64
    tiles = -(-num_tokens // block_m)
    split = max(1, min(in_features // (256 if num_tokens <= 64 else 512), 128 // tiles))
    expand = (16, 64, 1, 4, 3) if small else (64, 128, 1, 4, 3)
    return LoRAConfig((block_m, 128, split, 4, 3), expand, num_tokens <= BY_SLOT_MAX_T)


def _slice_scalars(offsets: tuple[int, ...], chunk: int) -> tuple[list[int], int]:
    """(o1..o4, c1..c3) for _chunk_columns, and the number of column chunks."""
    firsts, total = [], 0
    for lo, hi in zip(offsets, offsets[1:]):
        firsts.append(total)
        total += -(-(hi - lo) // chunk)
    ends = list(offsets[1:]) + [offsets[-1]] * (MAX_SLICES + 1 - len(offsets))
    starts = firsts[1:] + [_NONE] * (MAX_SLICES - len(offsets) + 1)
    return ends + starts, total


def _r_pad(columns: int) -> int:
    return max(16, triton.next_power_of_2(columns))  # tl.dot needs >= 16


def _shrink_partials(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, r: int,
                     rank: int, cfg: ShrinkConfig, by_slot: bool) -> torch.Tensor:
    """[SPLIT_K, T, n_slices * r] fp32 partial shrinks; columns >= rank of a slice are left
    unset (never read)."""
    block_m, block_k, split, warps, stages = cfg
    (num_tokens, k), (slots_n, n_rows, _) = x.shape, lora_a.shape
    n_cols = n_rows // r * rank
    alloc = torch.empty if rank == r else torch.zeros
    h = alloc(split, num_tokens, n_rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, block_m), split, slots_n if by_slot else 1)
    _lora_shrink_kernel[grid](
        x, lora_a, slots, h, num_tokens, k, slots_n, r, rank, n_cols,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, R_PAD=_r_pad(n_cols),
        DOT_PRECISION=dot_precision(x.dtype), UPCAST=INTERPRET, num_warps=warps,
        num_stages=stages,
    )
    return h


def _launch_expand(h: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                   offsets: tuple[int, ...], rank: int, cfg: ExpandConfig, by_slot: bool) -> None:
    block_m, block_n, chunk_blocks, warps, stages = cfg
    scalars, chunks = _slice_scalars(offsets, block_n * chunk_blocks)
    grid = (triton.cdiv(y.shape[0], block_m), chunks, lora_b.shape[0] if by_slot else 1)
    _lora_expand_kernel[grid](
        h, lora_b, slots, y, y.shape[0], lora_b.shape[0], lora_b.shape[2], rank, h.shape[0],
        h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0), *scalars,
        chunk_blocks, BLOCK_M=block_m, BLOCK_N=block_n, R_PAD=_r_pad(rank),
        DOT_PRECISION=dot_precision(lora_b.dtype), num_warps=warps, num_stages=stages,
    )


_TICKETS: dict[torch.device, torch.Tensor] = {}  # per device: the fused kernel's counters
_TICKET_COUNT = 1 << 16


def _tickets(device: torch.device, needed: int) -> torch.Tensor:
    """The device's [_TICKET_COUNT] int32 arrival counters, zeroed once and kept for the
    process: every fused call leaves them 0."""
    if needed > _TICKET_COUNT:
        raise ValueError(f"{needed} fused blocks exceed the {_TICKET_COUNT} counters")
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(_TICKET_COUNT, dtype=torch.int32, device=device)
    return _TICKETS[device]


def _launch_fused(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  slots: torch.Tensor, y: torch.Tensor, offsets: tuple[int, ...], rank: int,
                  cfg: FusedConfig) -> None:
    (num_tokens, k), (slots_n, n, r) = x.shape, lora_b.shape
    scalars, chunks = _slice_scalars(offsets, cfg.block_n)
    groups = slots_n if cfg.by_slot else 1
    grid = (triton.cdiv(num_tokens, cfg.block_m), chunks, groups * cfg.split_k)
    parts = y  # never read with split_k 1
    if cfg.split_k > 1:
        parts = torch.empty(cfg.split_k, num_tokens, n, dtype=torch.float32, device=y.device)
    tickets = _tickets(y.device, grid[0] * chunks * groups)
    _lora_fused_kernel[grid](
        x, lora_a, lora_b, slots, y, parts, tickets, num_tokens, k, slots_n, r, rank, groups,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), parts.stride(0) if cfg.split_k > 1 else 0, parts.stride(-2), *scalars,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, R_PAD=_r_pad(rank),
        SPLIT_K=cfg.split_k, DOT_PRECISION=dot_precision(x.dtype), UPCAST=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _check(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
           y: torch.Tensor, offsets: tuple[int, ...], max_rank: int | None) -> int:
    """Validates the shapes of a lora_apply call; returns the rank to read."""
    (num_tokens, k), (slots_n, n_rows, a_k), (b_slots, n, r) = x.shape, lora_a.shape, lora_b.shape
    n_slices = len(offsets) - 1
    if not 1 <= n_slices <= MAX_SLICES or offsets[0] != 0 or offsets[-1] != n:
        raise ValueError(f"slice_offsets {offsets} must run from 0 to N={n}, 1..4 slices")
    if any(hi < lo for lo, hi in zip(offsets, offsets[1:])):
        raise ValueError(f"slice_offsets {offsets} must not decrease")
    if a_k != k or b_slots != slots_n or n_rows != n_slices * r:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} / lora_b {tuple(lora_b.shape)} do not "
                         f"fit x {tuple(x.shape)} with {n_slices} slices")
    if y.shape != (num_tokens, n) or slots.shape != (num_tokens,):
        raise ValueError(f"y {tuple(y.shape)} / slots {tuple(slots.shape)} do not fit "
                         f"{num_tokens} tokens of width {n}")
    if not x.dtype == y.dtype == lora_a.dtype == lora_b.dtype or slots.dtype != torch.int32:
        raise ValueError(f"x, y, lora_a, lora_b must share a dtype and slots be int32, got "
                         f"{x.dtype} {y.dtype} {lora_a.dtype} {lora_b.dtype} {slots.dtype}")
    if any(t.stride(-1) != 1 for t in (x, lora_a, lora_b, y)):
        raise ValueError("x, y, lora_a and lora_b need contiguous rows")
    rank = r if max_rank is None else max_rank
    if not 1 <= rank <= r:
        raise ValueError(f"max_rank {max_rank} is outside 1..{r}")
    return rank


def lora_apply(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, n_slices * R, in]
    lora_b: torch.Tensor,  # [S, N, R], scaling multiplied in
    slots: torch.Tensor,  # [T] int32: slot of each token, -1 none
    y: torch.Tensor,  # [T, N], accumulated in place
    slice_offsets: tuple[int, ...],  # n_slices + 1 column offsets into y, 0 .. N
    *,
    max_rank: int | None = None,  # read only the first max_rank rows of each slice's R
    config: LoRAConfig | FusedConfig | None = None,  # tiles (None: choose_config's)
) -> None:
    """y[t] += B_s[slice cols] (A_s[slice rows] x[t]) for every slice, s = slots[t] >= 0, in
    place; rows of slot -1 (or any slot outside [0, S)) are left untouched.

    On CUDA (or under TRITON_INTERPRET) one fused launch (FusedConfig) or a shrink and an
    expand launch (LoRAConfig), no host sync: CUDA-graph safe. Elsewhere, or without triton,
    lora_apply_ref."""
    rank = _check(x, lora_a, lora_b, slots, y, slice_offsets, max_rank)
    if triton is None or not (x.is_cuda or INTERPRET):
        lora_apply_ref(x, lora_a, lora_b, slots, y, slice_offsets, max_rank=max_rank)
        return
    if x.shape[0] == 0:
        return
    cfg = config or choose_config(x.shape[0], x.shape[1], y.shape[1])
    if isinstance(cfg, FusedConfig):
        _launch_fused(x, lora_a, lora_b, slots, y, slice_offsets, rank, cfg)
        return
    h = _shrink_partials(x, lora_a, slots, lora_b.shape[2], rank, cfg.shrink, cfg.by_slot)
    _launch_expand(h, lora_b, slots, y, slice_offsets, rank, cfg.expand, cfg.by_slot)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, *,
    config: LoRAConfig | None = None,
) -> torch.Tensor:  # [T, n_slices * R] fp32
    """h[t] = A_s x[t] for s = slots[t] >= 0 (all n_slices * R rows), 0 on other rows."""
    cfg = config or choose_two_pass(x.shape[0], x.shape[1])
    n_rows = lora_a.shape[1]
    return _shrink_partials(x, lora_a, slots, n_rows, n_rows, cfg.shrink, cfg.by_slot).sum(0)


def lora_expand(
    h: torch.Tensor,  # [T, n_slices * R] fp32, lora_shrink's
    lora_b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor, slice_offsets: tuple[int, ...],
    *, config: LoRAConfig | None = None,
) -> None:
    """y[t, slice i] += h[t, i*R:(i+1)*R] . B_s[slice i]^T for s = slots[t] >= 0, in place."""
    cfg = config or choose_two_pass(y.shape[0], 0)
    _launch_expand(h.unsqueeze(0), lora_b, slots, y, slice_offsets, lora_b.shape[2],
                   cfg.expand, cfg.by_slot)


# ---- reference ---------------------------------------------------------------------------------
def lora_apply_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: tuple[int, ...],
    *,
    max_rank: int | None = None,
    config: LoRAConfig | FusedConfig | None = None,  # ignored: lora_apply's signature
) -> None:
    """lora_apply in torch, any device: fp32 math, y rounded once. Groups rows by slot (one
    host sync), so a batch of few adapters costs two matmuls per slice and adapter."""
    rank = _check(x, lora_a, lora_b, slots, y, slice_offsets, max_rank)
    r = lora_b.shape[2]
    for s in torch.unique(slots).tolist():
        if not 0 <= s < lora_a.shape[0]:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        if rows.numel() == x.shape[0]:  # one adapter for the whole batch: no gather
            rows = slice(None)
        h = x[rows].float() @ lora_a[s].float().T  # [rows, n_slices * R]
        delta = torch.empty(h.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        for i, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:])):
            b = lora_b[s, lo:hi, :rank].float()  # [width, rank]
            delta[:, lo:hi] = h[:, i * r:i * r + rank] @ b.T
        y[rows] = (y[rows].float() + delta).to(y.dtype)
