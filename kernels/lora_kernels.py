"""The @triton.jit kernels of batched multi-LoRA (kernels/lora.py holds the launchers, the
tiles and the torch reference): y[t] += B_s (A_s x[t]), s = slots[t], in place.

NOTE: two ways through, picked by lora.choose_config from the number of tokens T.

Prefill and decode batches of several tokens: two launches, a shrink then an expand, each
over a grid whose third axis splits the slots into G groups (slot % G == group): G = S up to
512 tokens, G = 1 for prefill.

    shrink  grid (token tiles, K splits, G):  h[split, t, j] = x[t, K part] . A_s[j, K part]
    expand  grid (token tiles, column chunks, G):  y[t, n] += sum_split h[., t, slice i] . B_s[n]

Batch-1 decode (T <= lora.FUSED_MAX_T): ONE launch (_lora_fused_kernel), since there a
launch costs more than the work. Each program owns (a token tile, a column chunk, a slot
group, a K part) and computes the shrink of its own tile itself, over its K part and only the
R rows of its chunk's slice (A_s of one slice is R x K: 64 KB at K 2048, read from L2 by
every chunk), then expands it onto its chunk:

    grid (token tiles, column chunks, G * SPLIT_K):
        part[p, t, cols] = B_s[cols] (A_s[slice rows, K part p] x[t, K part p])   (fp32)

With SPLIT_K = 1 the program adds its part to y. Else it stores the part in a workspace and
takes a ticket from its (tile, chunk, group) counter; the SPLIT_K-th arrival sums the SPLIT_K
parts in order (deterministic), does the one read-add-write of y and sets the counter back to
0 for the next call (stream order: calls must not overlap on two streams). A program loads
its y block and each pass's B chunk before the shrink, so their latency hides behind it.

A program walks the distinct slots of its tile that fall in its group, smallest first:

    slots (BLOCK_M 8) = [2, 2, -1, 0, 2, 0, 3, pad]     G = 1; pad (past T) reads as -1
    pass 1: cur = 0   rows {3, 5}      x rows of other slots load as 0 (masked, not read)
    pass 2: cur = 2   rows {0, 1, 4}
    pass 3: cur = 3   rows {6}         then no pending row: done; rows 2 and 7 add nothing

Each pass reads slot cur's A (or B) once for the whole tile and runs one tl.dot on it, so a
prefill tile (one adapter: a contiguous run) costs one pass, and so does a decode tile whose
tokens share an adapter. With G = S every program has at most one pass and the passes run
side by side (programs whose group has no row in the tile exit at once). A y element is
written only by the program of its row's slot, so groups never race. Deltas accumulate in
fp32 over every pass before the one read-add-write of a y block (rounded once).

Column chunks never straddle slices; a program finds its slice from the slice offsets passed
as scalars (at most MAX_SLICES). Grids depend on shapes alone and slots are read on the
device: no host sync, CUDA-graph safe.

Without triton the module still imports: the @jit functions stay plain (never called).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # a torch-only install: lora.lora_apply runs lora_apply_ref
    triton = tl = None

    def jit(fn):  # type: ignore[no-redef]
        return fn


MAX_SLICES = 4
_NO_SLOT = tl.constexpr(1 << 30) if tl else 0  # above every slot index: "no pending row"


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


@jit
def _lora_fused_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, n_slices * R, K]
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32, -1: no adapter
    y_ptr,  # [T, N], accumulated in place
    part_ptr,  # [SPLIT_K, T, N] fp32 workspace: the K parts' deltas (unused if SPLIT_K == 1)
    ticket_ptr,  # [>= token tiles * column chunks * G] int32 arrival counters, left 0
    T, K, S, R, rank, G,  # G slot groups: grid axis 2 is G * SPLIT_K
    stride_xm, stride_as, stride_ar, stride_bs, stride_bn, stride_ym, stride_ps, stride_pm,
    o1, o2, o3, o4, c1, c2, c3,  # slice ends (o4 = N), first chunks of slices 1..3
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_PAD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    group, k_part = tl.program_id(2) // SPLIT_K, tl.program_id(2) % SPLIT_K
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_rows = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    mine = (slot_rows >= 0) & (slot_rows < S) & (slot_rows % G == group)
    if tl.max(mine.to(tl.int32), 0) == 0:  # the same for the SPLIT_K parts: none takes a ticket
        return
    sl, col_lo, col_hi = _chunk_columns(tl.program_id(1), o1, o2, o3, o4, c1, c2, c3, BLOCK_N)
    cols = col_lo + tl.arange(0, BLOCK_N)
    mask = mine[:, None] & (cols < col_hi)[None, :]
    y_tile = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0)  # early: its latency hides behind the shrink
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = k_part * per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pending = mine
    cur = _next_slot(slot_rows, pending)
    while cur < _NO_SLOT:
        rows = slot_rows == cur
        b = tl.load(b_ptr + cur.to(tl.int64) * stride_bs + cols[None, :] * stride_bn
                    + offs_r[:, None], mask=r_mask[:, None] & (cols < col_hi)[None, :],
                    other=0.0)  # [R, BN], loaded before the shrink it waits for
        h = _shrink_tile(x_ptr, a_ptr, offs_m, slot_rows, rows, sl * R + offs_r, r_mask, k_lo,
                         tl.minimum(k_lo + per_split, K), stride_xm, stride_as, stride_ar,
                         BLOCK_M, BLOCK_K, R_PAD, DOT_PRECISION, UPCAST)  # [M, R], 0 off rows
        acc += tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION)  # [M, BN]
        pending = pending & (slot_rows != cur)
        cur = _next_slot(slot_rows, pending)
    if SPLIT_K > 1:
        part = part_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + cols[None, :]
        tl.store(part + k_part * stride_ps, acc, mask=mask)
        tl.debug_barrier()  # every thread's part stored before the ticket (release) is taken
        block = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * G + group
        ticket = tl.atomic_add(ticket_ptr + block, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last K part of this block to arrive: sums them all
            tl.atomic_xchg(ticket_ptr + block, 0, sem="relaxed", scope="gpu")  # for the next call
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)
