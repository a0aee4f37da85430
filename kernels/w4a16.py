"""W4A16 GEMM: y [M, N] = x [M, K] @ W [K, N], W held as 4-bit codes with per-group scales and
zeros, de-quantized in registers; the activations stay in their own dtype (bf16 / fp16 / fp32).

The layout every W4A16 checkpoint (AWQ, GPTQ, compressed-tensors) is turned into on load:

    qweight [K / 8, N] int32   codes packed along K: nibble j (bits 4j..4j+3) of qweight[i, n]
                               is the code of row k = 8 i + j, column n, in 0..15
    scales  [K / G, N] fp32    one per group of G consecutive rows of K and column
    zeros   [K / G, N] uint8   likewise, 0..16 (GPTQ v1 checkpoints reach 16)

        W[k, n] = (code[k, n] - zeros[k // G, n]) * scales[k // G, n]

(act-order checkpoints arrive with K permuted so that groups are consecutive; the caller
gathers x's columns the same way first, engine/quant/w4a16_linear.py.)

NOTE: grid (M tiles x N tiles, 1, SPLIT_K), the tiles taken in groups of GROUP_M row tiles
down one column tile before the next column (consecutive programs share W's columns and x's
rows in L2: in row-major order a wave would stream all of a long prefill's x once per column
tile). Each program walks its share of K in BLOCK_K steps,
BLOCK_K dividing G so that a step lies in one group: an x tile [BM, BK], the codes of a
[BK, BN] tile (BK / 8 rows of int32 read once, each shifted into its 8 rows), minus the group's
zeros: small integers, exact in x's dtype; one dot into fp32, times the group's scales. With
SPLIT_K > 1 (few rows of x) enough programs stream the weights to fill the GPU: each stores its
fp32 part in a workspace [SPLIT_K, M, N] and takes a ticket; the last of a tile to arrive sums
the parts and writes y (no second kernel; the tickets are left 0 for the next call).

    acc[m, n] = sum_groups s[g, n] * sum_{k in g} x[m, k] * (code[k, n] - z[g, n])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, dot_precision

PACK = 8  # codes per int32
MAX_BLOCK_K = 128
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- layout and reference ------------------------------------------------------------------------
def pack_rows(codes: torch.Tensor) -> torch.Tensor:  # [K, N] ints 0..15 -> [K / 8, N] int32
    """Eight consecutive rows into one int32 row, row 8 i + j in bits 4j..4j+3."""
    k, n = codes.shape
    if k % PACK:
        raise ValueError(f"pack_rows needs rows in multiples of {PACK}, got {k}")
    nibbles = codes.to(torch.int64).view(k // PACK, PACK, n)
    shifts = torch.arange(0, 4 * PACK, 4, device=codes.device).view(1, PACK, 1)
    packed = (nibbles << shifts).sum(dim=1)  # [K / 8, N] in 0 .. 2^32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:  # [R, N] int32 -> [8 R, N] uint8
    shifts = torch.arange(0, 4 * PACK, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(1) >> shifts.view(1, PACK, 1)) & 15  # [R, 8, N]
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def dequantize_ref(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:  # -> W [K, N] fp32
    codes = unpack_rows(qweight).float()
    group = torch.arange(codes.shape[0], device=codes.device) // group_size
    return (codes - zeros.float()[group]) * scales.float()[group]


def w4a16_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:  # [M, K] -> [M, N] in x's dtype: de-quantize, then an fp32 matmul
    return (x.float() @ dequantize_ref(qweight, scales, zeros, group_size)).to(x.dtype)


# ---- the kernel ----------------------------------------------------------------------------------
@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations
    q_ptr,  # [K / 8, N] int32 packed codes
    s_ptr,  # [K / G, N] fp32 scales
    z_ptr,  # [K / G, N] uint8 zeros
    out_ptr,  # [M, N] x's dtype
    part_ptr,  # [SPLIT_K, M, N] fp32 workspace (unused if SPLIT_K == 1)
    ticket_ptr,  # [>= M tiles * N tiles] int32 arrival counters, left 0
    M,
    N,
    K,
    group_size,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,  # widen dot operands to fp32 (the interpreter; fp32 models)
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    rk = tl.arange(0, BLOCK_K)
    ri = tl.arange(0, BLOCK_K // 8)  # the step's rows of qweight
    shifts = tl.arange(0, 8) * 4  # where row 8 i + j sits in int32 i
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_stop, BLOCK_K):  # K is a multiple of BLOCK_K: no K masks
        x = tl.load(x_rows + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)  # [BM, BK]
        q_tile = q_ptr + (k // 8 + ri)[:, None].to(tl.int64) * stride_qk + rn[None, :]
        packed = tl.load(q_tile, mask=n_mask[None, :], other=0)  # [BK / 8, BN]
        group_row = (k // group_size).to(tl.int64) * stride_sg
        scale = tl.load(s_ptr + group_row + rn, mask=n_mask, other=0.0)  # [BN]
        zero = tl.load(z_ptr + group_row + rn, mask=n_mask, other=0).to(tl.int32)  # [BN]
        codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK / 8, 8, BN]
        w = tl.reshape(codes, (BLOCK_K, BLOCK_N)) - zero[None, :]  # [BK, BN] in -16..15
        if UPCAST:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            part = tl.dot(x, w.to(x.dtype))
        acc += part * scale[None, :]
    mask = (rm[:, None] < M) & n_mask[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    parts = part_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    store_split_k(acc, out, mask, parts, M * N, ticket_ptr + tl.program_id(0), SPLIT_K)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile) in grouped order: GROUP_M row tiles down one
    column tile before the next column, so consecutive programs share tiles in L2."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    first_m = tile // (GROUP_M * tiles_n) * GROUP_M
    height = tl.minimum(tiles_m - first_m, GROUP_M)  # row tiles in this group
    return first_m + (tile % (GROUP_M * tiles_n)) % height, (tile % (GROUP_M * tiles_n)) // height


@triton.jit
def store_split_k(acc, out, mask, parts, stride_split, ticket, SPLIT_K: tl.constexpr):
    """Store `acc` (fp32) at `out` in its dtype. With SPLIT_K > 1 it is this K share's part:
    stored at `parts` (+ share * stride_split), a ticket taken, and the last share of the tile
    to arrive sums them all into `out` and leaves the ticket 0."""
    if SPLIT_K == 1:
        tl.store(out, acc.to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(parts + tl.program_id(2) * stride_split, acc, mask=mask)
        tl.debug_barrier()  # every thread's part stored before the ticket (release) is taken
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # for the next call
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(parts + s * stride_split, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out, total.to(out.dtype.element_ty), mask=mask)


def block_k_for(group_size: int, minimum: int = 16) -> int | None:
    """The K step: the largest power of two <= 128 dividing the group (None below `minimum`:
    a tensor-core dot takes 16)."""
    block = MAX_BLOCK_K
    while block >= minimum:
        if group_size % block == 0:
            return block
        block //= 2
    return None


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (1 elsewhere: no K split fills a CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(x: torch.Tensor, programs: int, steps: int, per_sm: int = 4,
                most: int = 16, at_most: bool = False) -> int:
    """Enough K shares for ~`per_sm` programs per SM (at most the K steps and `most`); with
    `at_most`, as many as keep it at or under `per_sm`. H100, 1B shapes: the best tiles at
    M <= 16 wanted 256-512 programs (docs/benchmarks.md)."""
    if x.device.type != "cuda" or programs == 0:  # M = 0: nothing is launched
        return 1
    slots = per_sm * sm_count(x.device)
    want = slots // programs if at_most else triton.cdiv(slots, programs)
    return max(1, min(want, steps, most))


_TICKETS: dict[torch.device, torch.Tensor] = {}  # per device: split-K arrival counters
_TICKET_COUNT = 1 << 16


def tickets(device: torch.device, needed: int) -> torch.Tensor:
    """The device's [_TICKET_COUNT] int32 arrival counters, zeroed once and kept for the
    process: every split-K call leaves them 0."""
    if needed > _TICKET_COUNT:
        raise ValueError(f"{needed} split-K tiles exceed the {_TICKET_COUNT} counters")
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(_TICKET_COUNT, dtype=torch.int32, device=device)
    return _TICKETS[device]


@dataclass(frozen=True)
class SplitKPlan:
    """A split-K launch over `tiles` (M tiles, N tiles) of the output: `split` K shares of
    `k_per_split` (whole K steps) each, none empty (the last may be shorter)."""

    tiles: tuple[int, int]
    split: int
    k_per_split: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (*self.tiles, self.split)

    @property
    def flat_grid(self) -> tuple[int, int, int]:
        """The tiles as one axis (the GEMM's grouped order), K shares on the third."""
        return (self.tiles[0] * self.tiles[1], 1, self.split)

    @classmethod
    def whole_steps(cls, k: int, block_k: int, tiles: tuple[int, int], split: int) -> SplitKPlan:
        """K cut into at most `split` shares of whole `block_k` steps (the last share may be
        shorter, its last step partly past K); the count recomputed, as rounding up may leave
        fewer (4 steps in 3 shares: 2 and 2)."""
        k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
        return cls(tiles, triton.cdiv(k, k_per_split), k_per_split)

    def workspace(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(parts [split, M, N] fp32, tickets) for the launch (x itself when one share)."""
        if self.split == 1:
            return x, x
        parts = torch.empty(self.split, x.shape[0], n, dtype=torch.float32, device=x.device)
        return parts, tickets(x.device, self.tiles[0] * self.tiles[1])


def split_k_plan(x: torch.Tensor, k: int, block_k: int, tiles: tuple[int, int],
                 split_k: int | None = None, per_sm: int = 4, most: int = 16,
                 at_most: bool = False) -> SplitKPlan:
    """K (a multiple of `block_k`) cut into `split_k` shares, by default `split_k_for`'s, of
    whole steps (`SplitKPlan.whole_steps`)."""
    split = split_k or split_k_for(x, tiles[0] * tiles[1], k // block_k, per_sm, most, at_most)
    return SplitKPlan.whole_steps(k, block_k, tiles, split)


def check_inputs(what: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, block_k: int | None) -> None:
    """ValueError unless x [M, K] and the layout above fit, with a K step for the group."""
    if x.dim() != 2 or x.stride(-1) != 1 or qweight.dim() != 2 or qweight.stride(-1) != 1:
        raise ValueError(f"{what} needs 2-D x and qweight with contiguous rows")
    (_, k), (k8, n) = x.shape, qweight.shape
    groups = k // group_size if group_size > 0 and k % group_size == 0 else -1
    if (x.dtype not in ACT_DTYPES or qweight.dtype != torch.int32 or k8 * PACK != k
            or scales.shape != (groups, n) or scales.dtype != torch.float32
            or zeros.shape != (groups, n) or zeros.dtype != torch.uint8 or block_k is None
            or not scales.is_contiguous() or not zeros.is_contiguous()):
        raise ValueError(
            f"{what}: x {tuple(x.shape)} {x.dtype}, qweight {tuple(qweight.shape)} "
            f"{qweight.dtype}, scales {tuple(scales.shape)} {scales.dtype}, zeros "
            f"{tuple(zeros.shape)} {zeros.dtype}, group {group_size}: need [M, K] fp16/bf16/fp32, "
            "[K/8, N] int32, [K/G, N] fp32 and uint8, G dividing K with a K step for it"
        )


@dataclass(frozen=True)
class GemmTile:
    """A launch shape of the GEMM: output tile BLOCK_M x BLOCK_N, warps, software pipeline
    stages, row tiles a group (see NOTE)."""

    block_m: int
    block_n: int
    warps: int = 4
    stages: int = 3
    group_m: int = 8


def default_tile(m: int) -> GemmTile:
    """The tile for M rows: 16-row tiles (and split-K) for decode-sized M, 64 x 64 above.
    Larger tiles were slower still (H200, docs/benchmarks.md "W4A16 at batch and prefill
    sizes"): above 64 rows the layer de-quantizes and calls cuBLAS instead."""
    return GemmTile(16, 64) if m <= 16 else GemmTile(64, 64)


def w4a16_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, blocks: tuple[int, int] | GemmTile | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """[M, K] x the 4-bit W [K, N] (the layout above) -> [M, N] in x's dtype; see `w4a16_ref`.
    `blocks`: a `GemmTile` or (BLOCK_M, BLOCK_N), by default `default_tile(M)`; `split_k`: K
    shares, by default enough to fill the GPU at small M. ValueError for shapes, strides or
    dtypes it cannot take."""
    block_k = block_k_for(group_size) if group_size > 0 else None
    check_inputs("w4a16_linear", x, qweight, scales, zeros, group_size, block_k)
    (m, k), n = x.shape, qweight.shape[1]
    tile = blocks if isinstance(blocks, GemmTile) else (
        GemmTile(*blocks) if blocks else default_tile(m))
    tiles = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
    plan = split_k_plan(x, k, block_k, tiles, split_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    parts, counters = plan.workspace(x, n)
    _w4a16_kernel[plan.flat_grid](
        x, qweight, scales, zeros, out, parts, counters, m, n, k, group_size, plan.k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=tile.group_m,
        SPLIT_K=plan.split, UPCAST=INTERPRET or x.dtype == torch.float32,
        PRECISION=dot_precision(x.dtype), num_warps=tile.warps, num_stages=tile.stages,
    )
    return out
