"""Batched multi-LoRA (Punica's BGMV/SGMV): y[t] += B_s (A_s x[t]), s = slots[t], in place.

NOTE: two launches, a shrink then an expand, each over a grid whose third axis splits the
slots into G groups (slot % G == group): G = S at decode sizes, G = 1 for prefill.

    shrink  grid (token tiles, K splits, G):  h[split, t, j] = x[t, K part] . A_s[j, K part]
    expand  grid (token tiles, column chunks, G):  y[t, n] += sum_split h[., t, slice i] . B_s[n]

A program walks the distinct slots of its tile that fall in its group, smallest first:

    slots (BLOCK_M 8) = [2, 2, -1, 0, 2, 0, 3, pad]     G = 1; pad (past T) reads as -1
    pass 1: cur = 0   rows {3, 5}      x rows of other slots load as 0 (masked, not read)
    pass 2: cur = 2   rows {0, 1, 4}
    pass 3: cur = 3   rows {6}         then no pending row: done; rows 2 and 7 add nothing

Each pass reads slot cur's A (or B) once for the whole tile and runs one tl.dot on it, so a
prefill tile (one adapter: a contiguous run) costs one pass. At decode a tile mixes adapters;
with G = S every program has at most one pass and the passes run side by side (programs
whose group has no row in the tile exit at once). A y element is written only by the program
of its row's slot, so groups never race. The expand masks h to the pass's rows and accumulates
every pass in fp32 before the one read-add-write of its y block (rounded once).

Splitting K gives a few tokens enough programs to fill the GPU; the expand sums the fp32
partials. Measured on an H100 in CUDA graphs (pdserve/bench/gpu_lora_kernels.py), this pair beat
a fused single launch (shrink recomputed per column chunk) at every size tried, T = 1 included
(qkv 5.7 us against 7.1, down 6.0 against 14.3): the fused kernel's serial K loop costs more
than the second launch. Column chunks never straddle
slices; a program finds its slice from the slice offsets passed as scalars (at most MAX_SLICES).
Grids depend on shapes alone and slots are read on the device: no host sync, CUDA-graph safe.

Without triton the module still imports: the @jit functions stay plain (never called) and
lora_apply falls back to lora_apply_ref, the torch path the engine uses on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import INTERPRET, dot_precision

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # a torch-only install: lora_apply runs lora_apply_ref
    triton = tl = None

    def jit(fn):  # type: ignore[no-redef]
        return fn


MAX_SLICES = 4
_NO_SLOT = tl.constexpr(1 << 30) if tl else 0  # above every slot index: "no pending row"
_NONE = 1 << 30  # first chunk of a missing slice: never reached


# ---- device code -------------------------------------------------------------------------------
@jit
def _next_slot(slot_rows, pending):
    return tl.min(tl.where(pending, slot_rows, _NO_SLOT), 0)


@jit
def _tile_rows(slots_ptr, T, S, BLOCK_M: tl.constexpr):
    """The tile's rows, their slots, rows with an adapter, and those of this program's group."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_rows = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    active = (slot_rows >= 0) & (slot_rows < S)
    return offs_m, slot_rows, active, active & (slot_rows % tl.num_programs(2) == tl.program_id(2))


@jit
def _shrink_tile(
    x_ptr,  # [T, K]
    a_ptr,  # [S, n_slices * R, K]
    offs_m,  # [BLOCK_M] token rows of the tile
    slot_rows,  # [BLOCK_M] their slots
    mine,  # [BLOCK_M] rows this program serves
    a_rows,  # [R_PAD] rows of A to read
    a_rows_mask,  # [R_PAD]
    k_lo,
    k_hi,
    stride_xm,
    stride_as,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """h[t, j] = sum_{k in [k_lo, k_hi)} x[t, k] A_slot(t)[a_rows[j], k] in fp32; 0 on rows
    not `mine`."""
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [M, 1]
    h = tl.zeros([BLOCK_M, R_PAD], tl.float32)
    pending = mine
    cur = _next_slot(slot_rows, pending)
    while cur < _NO_SLOT:
        rows = slot_rows == cur
        a_cols = a_ptr + cur.to(tl.int64) * stride_as + a_rows[None, :] * stride_ar  # [1, R]
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < k_hi
            xt = tl.load(x_rows + kk[None, :], mask=rows[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_cols + kk[:, None], mask=k_mask[:, None] & a_rows_mask[None, :],
                         other=0.0)  # [BK, R]
            if UPCAST:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            h += tl.dot(xt, at, input_precision=DOT_PRECISION)
        pending = pending & (slot_rows != cur)
        cur = _next_slot(slot_rows, pending)
    return h


@jit
def _chunk_columns(pid, o1, o2, o3, o4, c1, c2, c3, chunk):
    """Column chunk `pid` -> (its slice, first column, end column); c_i is slice i's first
    chunk, o_i slice i's first column (o_n = N)."""
    sl = (pid >= c1).to(tl.int32) + (pid >= c2).to(tl.int32) + (pid >= c3).to(tl.int32)
    lo = tl.where(sl == 0, 0, tl.where(sl == 1, o1, tl.where(sl == 2, o2, o3)))
    hi = tl.where(sl == 0, o1, tl.where(sl == 1, o2, tl.where(sl == 2, o3, o4)))
    first = tl.where(sl == 0, 0, tl.where(sl == 1, c1, tl.where(sl == 2, c2, c3)))
    start = lo + (pid - first) * chunk
    return sl, start, tl.minimum(start + chunk, hi)


@jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, n_slices * R, K]
    slots_ptr,  # [T] int32, -1: no adapter
    h_ptr,  # [split, T, n_slices * R] fp32 out: partial sums over K (split = grid axis 1)
    T, K, S, R, rank, n_cols,  # rank <= R rows of each slice read; n_cols = n_slices * rank
    stride_xm, stride_as, stride_ar, stride_hs, stride_hm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_m, slot_rows, active, mine = _tile_rows(slots_ptr, T, S, BLOCK_M)
    j = tl.arange(0, R_PAD)  # column j: slice j // rank, rank row j % rank
    a_rows = (j // rank) * R + j % rank
    per_split = tl.cdiv(tl.cdiv(K, tl.num_programs(1)), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * per_split
    h = _shrink_tile(x_ptr, a_ptr, offs_m, slot_rows, mine, a_rows, j < n_cols, k_lo,
                     tl.minimum(k_lo + per_split, K), stride_xm, stride_as, stride_ar,
                     BLOCK_M, BLOCK_K, R_PAD, DOT_PRECISION, UPCAST)
    # group 0 also writes the zeros of rows without an adapter: every row of h is defined
    zero_rows_end = tl.where(tl.program_id(2) == 0, T, 0)
    rows = mine | (~active & (offs_m < zero_rows_end))
    out = (h_ptr + tl.program_id(1) * stride_hs + offs_m.to(tl.int64)[:, None] * stride_hm
           + a_rows[None, :])
    tl.store(out, h, mask=rows[:, None] & (j < n_cols)[None, :])


@jit
def _lora_expand_kernel(
    h_ptr,  # [split, T, n_slices * R] fp32: partial shrinks, summed here
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32
    y_ptr,  # [T, N], accumulated in place
    T, S, R, rank, split,
    stride_hs, stride_hm, stride_bs, stride_bn, stride_ym,
    o1, o2, o3, o4, c1, c2, c3,  # slice ends (o4 = N), first chunks of slices 1..3
    chunk_blocks,  # BLOCK_N column blocks per program
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m, slot_rows, active, mine = _tile_rows(slots_ptr, T, S, BLOCK_M)
    sl, col_lo, col_hi = _chunk_columns(tl.program_id(1), o1, o2, o3, o4, c1, c2, c3,
                                        BLOCK_N * chunk_blocks)
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank
    h_tile = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + sl * R + offs_r[None, :]
    h = tl.zeros([BLOCK_M, R_PAD], tl.float32)
    for s in range(split):
        h += tl.load(h_tile + s * stride_hs, mask=mine[:, None] & r_mask[None, :], other=0.0)
    y_rows = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym
    for nb in range(chunk_blocks):
        cols = col_lo + nb * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = cols < col_hi
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        pending = mine
        cur = _next_slot(slot_rows, pending)
        while cur < _NO_SLOT:
            rows = slot_rows == cur
            b = tl.load(b_ptr + cur.to(tl.int64) * stride_bs + cols[None, :] * stride_bn
                        + offs_r[:, None], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
            hs = tl.where(rows[:, None], h, 0.0)
            acc += tl.dot(hs, b.to(tl.float32), input_precision=DOT_PRECISION)  # [M, BN]
            pending = pending & (slot_rows != cur)
            cur = _next_slot(slot_rows, pending)
        mask = mine[:, None] & c_mask[None, :]
        y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(y_rows + cols[None, :], (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


# ---- launchers ---------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_K, SPLIT_K, num_warps, num_stages)
ShrinkConfig = tuple[int, int, int, int, int]
# (BLOCK_M, BLOCK_N, CHUNK_BLOCKS, num_warps, num_stages)
ExpandConfig = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class LoRAConfig:
    """Tiles of one lora_apply; by_slot: a grid axis over the S slots (G = S), else G = 1."""

    shrink: ShrinkConfig
    expand: ExpandConfig
    by_slot: bool


# tiny tiles keep the interpreter's numpy arrays small; both slot groupings are tested
INTERPRET_CONFIGS = {
    by_slot: LoRAConfig((16, 16, 2, 1, 1), (16, 16, 2, 1, 1), by_slot) for by_slot in (False, True)
}
BY_SLOT_MAX_T = 512  # up to this many tokens (the engine's decode batches) a grid axis per slot


def choose_config(num_tokens: int, in_features: int, out_features: int) -> LoRAConfig:
    """Tiles measured best on an H100 for a 1B Llama's projections (rank 16, 4 slots; tuned by
    `python -m pdserve.bench.gpu_lora_kernels --tune`): 16-row shrink tiles up to 64 tokens
    with K split into ~256-wide parts, 64-row tiles above with ~512-wide parts, fewer splits
    once the token tiles alone fill the GPU; a grid axis per slot up to BY_SLOT_MAX_T tokens."""
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
    config: LoRAConfig | None = None,  # tiles (None: choose_config's)
) -> None:
    """y[t] += B_s[slice cols] (A_s[slice rows] x[t]) for every slice, s = slots[t] >= 0, in
    place; rows of slot -1 (or any slot outside [0, S)) are left untouched.

    On CUDA (or under TRITON_INTERPRET) a shrink and an expand launch, no host sync: CUDA-graph
    safe. Elsewhere, or without triton, lora_apply_ref."""
    rank = _check(x, lora_a, lora_b, slots, y, slice_offsets, max_rank)
    if triton is None or not (x.is_cuda or INTERPRET):
        lora_apply_ref(x, lora_a, lora_b, slots, y, slice_offsets, max_rank=max_rank)
        return
    if x.shape[0] == 0:
        return
    cfg = config or choose_config(x.shape[0], x.shape[1], y.shape[1])
    h = _shrink_partials(x, lora_a, slots, lora_b.shape[2], rank, cfg.shrink, cfg.by_slot)
    _launch_expand(h, lora_b, slots, y, slice_offsets, rank, cfg.expand, cfg.by_slot)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, *,
    config: LoRAConfig | None = None,
) -> torch.Tensor:  # [T, n_slices * R] fp32
    """h[t] = A_s x[t] for s = slots[t] >= 0 (all n_slices * R rows), 0 on other rows."""
    cfg = config or choose_config(x.shape[0], x.shape[1], 0)
    n_rows = lora_a.shape[1]
    return _shrink_partials(x, lora_a, slots, n_rows, n_rows, cfg.shrink, cfg.by_slot).sum(0)


def lora_expand(
    h: torch.Tensor,  # [T, n_slices * R] fp32, lora_shrink's
    lora_b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor, slice_offsets: tuple[int, ...],
    *, config: LoRAConfig | None = None,
) -> None:
    """y[t, slice i] += h[t, i*R:(i+1)*R] . B_s[slice i]^T for s = slots[t] >= 0, in place."""
    cfg = config or choose_config(y.shape[0], 0, y.shape[1])
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
    config: LoRAConfig | None = None,  # ignored: lora_apply's signature
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
