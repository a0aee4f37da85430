"""W4A16 GEMV for decode steps of a few tokens: y [M, N] = x [M, K] @ W [K, N], W in
kernels/w4a16.py's layout (`qweight` [K / 8, N] int32, group `scales` and `zeros` [K / G, N]);
the torch reference is `w4a16_ref` there.

NOTE: grid (M, N / BLOCK_N, SPLIT_K). Batch-1 decode reads each weight once and does almost
no arithmetic on it: what counts is bytes in flight and instructions per weight, not tensor
cores (a dot pads M to 16). Each program streams its rows of qweight, ROWS int32 rows of
BLOCK_N columns a step (8 ROWS rows of W: several groups when G is small, part of one when it
is large), and for each nibble j multiplies the codes by x's entries k = 8 i + j in fp32. The
sums are folded per group (GROUP_ROWS int32 rows each) and scaled once, the zeros coming out as
one term per group:

    sum_{k in g} x[k] (q[k, n] - z[g, n]) s[g, n] = s[g, n] (sum x[k] q[k, n] - z[g, n] sum x[k])

With PAIRS (16-bit x) the loop instead multiplies two codes an instruction in fp16, the zeros
subtracted exactly inside (kernels/nibble_pairs.py), and scales each int32's partial dot.
With TMA the codes' [ROWS, BLOCK_N] tiles come by descriptor into shared memory, STAGES of
them in flight, issued by one thread (more bytes on their way without more registers). Off in
the layer: slower on an H100 (2026-12-07, docs/benchmarks.md).

Rows of x beyond the first re-read W (from L2): for M <= GEMV_MAX_TOKENS only (the layer's
choice; the kernel takes any M). SPLIT_K > 1:
the K shares meet as in kernels/w4a16.py (`store_split_k`: a workspace and tickets).

x's entries may be computed in the prologue instead of read (kernels/gemv_inputs.py): the
layer's RMSNorm (and residual add) before q/k/v and gate_up, SwiGLU before down
(`w4a16_gemv_rmsnorm`, `w4a16_gemv_swiglu`), so those cost no launch. No PDL: on an H200 it
made these GEMVs slower alone (1.5-4 us a call) and gained nothing in the decode step
(docs/benchmarks.md, 2026-12-03).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.gemv_inputs import (
    NORM,
    NORM_RESIDUAL,
    PLAIN,
    PROLOGUE_BLOCK,
    SWIGLU,
    prefetch_l2,
    store_x_entries,
)
from kernels.nibble_pairs import PAIR_SCALE, pair_dots, x_pair, zero_pairs
from kernels.w4a16 import check_inputs, split_k_plan, store_split_k
from kernels.widen import nibble_times

# H100, Llama-3.2-1B shapes (docs/benchmarks.md): at M = 1 this GEMV beat the GEMM and bf16
# F.linear; at M = 4 the GEMM (split-K) beat it. M = 2, 3 not measured: they take the GEMM.
GEMV_MAX_TOKENS = 1
MAX_ROWS = 64  # int32 rows of qweight a step: 512 rows of W
# (BLOCK_N, max ROWS, num_warps) by weight size, the best of sweeps on an H200 at M = 1
# (pdserve/bench/gpu_w4a16.py): a small weight wants many small programs (the 2048 x 3072
# q/k/v: 5.3 us with 16 x 16 x 1 in 8 shares), a large one long steps, eight warps since the
# code pairs (2026-12-03, weights from DRAM: the 2048 x 16384 gate_up 10.9 us unsplit against
# 12.9 with four warps, the 8192 x 2048 down 8.4 in 8 shares against 9.0). Before that day
# the sweeps timed weights resident in the L2 (four warps then: gate_up 10.8 us).
SMALL_BLOCKS, LARGE_BLOCKS = (16, 16, 1), (64, MAX_ROWS, 8)
LARGE_WEIGHT = 1 << 24  # K x N codes from which LARGE_BLOCKS
# K shares by default: SMALL_BLOCKS' light programs (one warp, 1 KiB of codes a step) ~8 an SM,
# LARGE_BLOCKS' (eight warps, 16 KiB of codes a step) at most 2 an SM. H200, M = 1, 2026-12-03
# (pdserve/bench/gpu_w4a16.py, two calls, weights in the L2): gate_up 10.8 us unsplit against
# 12.5 in the 4 shares that ~8 an SM gave; the 8192 x 2048 down 7.4 us in 8 shares, 8.4 in 4.
SMALL_PER_SM, LARGE_PER_SM = 8, 2


def default_blocks(k: int, n: int) -> tuple[int, int, int]:
    return LARGE_BLOCKS if k * n >= LARGE_WEIGHT else SMALL_BLOCKS


def share_rule(blocks: tuple[int, int, int]) -> dict:
    """`split_k_plan`'s keywords for the default K shares of a GEMV of these blocks."""
    large = blocks == LARGE_BLOCKS
    return {"per_sm": LARGE_PER_SM if large else SMALL_PER_SM, "most": 8, "at_most": large}


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K] activations ([M, 2K] gate | up for SWIGLU)
    res_ptr,  # [M, K] the residual stream (NORM_RESIDUAL), contiguous
    nw_ptr,  # [K] RMSNorm weight (NORM, NORM_RESIDUAL)
    s_out_ptr,  # [M, K] x + residual, written (NORM_RESIDUAL), contiguous
    xc_ptr,  # [M, K] x's entries as computed (FORM != PLAIN), x's dtype, contiguous
    q_ptr,  # [K / 8, N] int32 packed codes
    q_desc,  # the same as a TMA descriptor of [ROWS, BLOCK_N] tiles (TMA), else q_ptr
    s_ptr,  # [K / G, N] fp32 scales
    z_ptr,  # [K / G, N] uint8 zeros
    out_ptr,  # [M, N] x's dtype
    part_ptr,  # [SPLIT_K, M, N] fp32 workspace (unused if SPLIT_K == 1)
    ticket_ptr,  # [>= M * N tiles] int32 arrival counters, left 0
    M,
    N,
    K,
    group_size,
    k_per_split,  # a multiple of 8 ROWS
    eps,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,  # int32 rows of qweight a step
    GROUP_ROWS: tl.constexpr,  # of them in one group: G / 8, or ROWS when a group spans steps
    SPLIT_K: tl.constexpr,
    FORM: tl.constexpr,  # how x's entries are computed (kernels/gemv_inputs.py)
    PRO_BLOCK: tl.constexpr,  # entries a step of the prologue's loops
    PREFETCH: tl.constexpr,  # the share's codes requested into L2 before the prologue
    LINES: tl.constexpr,  # 128-byte lines a row of a tile spans: cdiv(BLOCK_N, 32)
    PAIRS: tl.constexpr,  # 16-bit x: codes multiplied in pairs (kernels/nibble_pairs.py)
    PAIRS_ASM: tl.constexpr,  # by inline PTX (CUDA), else emulated (the interpreter)
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no column masks (each costs a register's zeroing)
    STAGES: tl.constexpr,  # the loop's software pipeline: steps of loads in flight
    TMA: tl.constexpr,  # the codes' tiles by the tensor memory accelerator (q_desc)
):
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    ri = tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    n_mask = rn[None, :] < N  # [1, BN]
    x_row = x_ptr + m * stride_xm
    if PREFETCH:  # the share's codes on their way to L2 while the prologue computes x
        lines = tl.minimum(tl.program_id(1) * BLOCK_N + tl.arange(0, LINES) * 32, N - 1)
        for k in range(k_start, k_stop, 8 * ROWS):
            prefetch_l2(q_ptr + (k // 8 + ri).to(tl.int64) * stride_qk + lines[None, :])
    if FORM != PLAIN:  # this share's entries of x computed once, then read as stored ones
        xc_row = xc_ptr + m * K
        store_x_entries(x_row, res_ptr + m * K, nw_ptr, s_out_ptr + m * K,
                        xc_row, k_start, k_stop, K, eps,
                        tl.where((tl.program_id(1) == 0) & (tl.program_id(2) == 0), K, 0),
                        FORM, PRO_BLOCK)
        x_row = xc_row
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    q_tile = q_ptr + ri.to(tl.int64) * stride_qk + rn[None, :]  # [ROWS, BN]: the step's words
    for k in tl.range(k_start, k_stop, 8 * ROWS, num_stages=STAGES):  # K: a multiple of 8 ROWS
        if TMA:
            packed = q_desc.load([k // 8, tl.program_id(1) * BLOCK_N])
        else:
            packed = _load_columns(q_tile + (k // 8) * stride_qk, n_mask, EVEN_N)  # [ROWS, BN]
        if ROWS <= GROUP_ROWS:  # the step lies in one group: a row of scales and zeros
            rows = (k // group_size) * stride_sg  # < 2^31: K / G groups x N
        else:  # several groups a step: each int32 row reads its own group's
            rows = ((k // 8 + ri) // GROUP_ROWS).to(tl.int64) * stride_sg  # [ROWS, 1]
        scale = _load_columns(s_ptr + rows + rn[None, :], n_mask, EVEN_N)
        zero = _load_columns(z_ptr + rows + rn[None, :], n_mask, EVEN_N)
        xk = x_row + k + ri * 8  # [ROWS, 1]: x[k + 8 i]
        if PAIRS:  # two codes an instruction in fp16, the zeros subtracted exactly
            is_bf16: tl.constexpr = x_row.dtype.element_ty == tl.bfloat16
            words = xk.to(tl.pointer_type(tl.int32))  # x[k + 8 i ..] as four int32
            w0, w1, w2, w3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), \
                tl.load(words + 3)
            zp, zq = zero_pairs(zero.to(tl.int32))
            dots = pair_dots(packed, zp, zq, x_pair(w0, w2, False, is_bf16, PAIRS_ASM),
                             x_pair(w0, w2, True, is_bf16, PAIRS_ASM),
                             x_pair(w1, w3, False, is_bf16, PAIRS_ASM),
                             x_pair(w1, w3, True, is_bf16, PAIRS_ASM), is_bf16, PAIRS_ASM)
            acc += scale * dots
        else:
            high = (packed >> 20) & 0xFFF  # nibbles 5..7 moved down to bits 0..11
            dots = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            x_sums = tl.zeros((ROWS, 1), dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(xk + j).to(tl.float32)  # x[k + 8 i + j]
                codes = nibble_times(packed if j < 5 else high, j % 5)  # q * 2^(4 (j % 5))
                dots += codes * (xj * 2.0 ** (-4 * (j % 5)))
                x_sums += xj
            acc += scale * (dots - zero.to(tl.float32) * x_sums)
    if PAIRS:
        acc *= PAIR_SCALE
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    store_split_k(tl.sum(acc, axis=0), out_ptr + m * stride_om + rn, rn < N,
                  part_ptr + m * N + rn, M * N, ticket_ptr + tile, SPLIT_K)


@triton.jit
def _load_columns(ptrs, n_mask, EVEN_N: tl.constexpr):
    if EVEN_N:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=n_mask, other=0)


def gemv_rows(group_size: int, k: int, max_rows: int = MAX_ROWS) -> tuple[int, int] | None:
    """(ROWS, GROUP_ROWS), powers of two: whole groups a step when G is a power of two of at
    most 8 max_rows rows of W, else the largest step within one group (None: G % 8)."""
    rows = max_rows
    if group_size & (group_size - 1) == 0 and 8 <= group_size <= 8 * max_rows:
        while k % (8 * rows):
            rows //= 2
        if 8 * rows >= group_size:
            return rows, group_size // 8
    while rows and group_size % (8 * rows):
        rows //= 2
    return (rows, rows) if rows else None


def w4a16_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, blocks: tuple[int, int, int] | None = None, split_k: int | None = None,
    pairs: bool | None = None, stages: int = 1, tma: bool = False,
) -> torch.Tensor:
    """[M, K] x the 4-bit W [K, N] -> [M, N] in x's dtype (kernels/w4a16.py `w4a16_ref`).
    `blocks`: (BLOCK_N, max ROWS, num_warps); `split_k`: K shares, by default enough to fill
    the GPU; `pairs`: codes multiplied two at a time in fp16 (kernels/nibble_pairs.py), by
    default wherever it can (CUDA, bf16 or fp16 x); `stages`: steps of loads in flight
    (Triton's software pipeline through shared memory); `tma`: the codes' tiles loaded by the
    tensor memory accelerator (Hopper), `stages` of them in flight. ValueError for shapes,
    strides or dtypes it cannot take."""
    return _launch(PLAIN, x, None, None, 0.0, x.shape[-1], qweight, scales, zeros, group_size,
                   blocks, split_k, pairs, stages, tma)[0]


def w4a16_gemv_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    blocks: tuple[int, int, int] | None = None, split_k: int | None = None,
    pairs: bool | None = None, stages: int = 1, tma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) @ W, x + residual): kernels/rmsnorm.py's `rms_norm` and then
    `w4a16_gemv`, one launch (`residual` None: the norm of x, and x)."""
    k = x.shape[-1]
    if (norm_weight.shape != (k,) or not norm_weight.is_contiguous()
            or norm_weight.dtype != x.dtype or (residual is not None and (
                residual.shape != x.shape or residual.dtype != x.dtype
                or not residual.is_contiguous()))):
        raise ValueError(
            f"w4a16_gemv_rmsnorm: x {tuple(x.shape)} {x.dtype}, residual "
            f"{None if residual is None else (tuple(residual.shape), residual.dtype)}, norm "
            f"weight {tuple(norm_weight.shape)} {norm_weight.dtype}: need a contiguous residual of "
            "x's shape and dtype, and a contiguous [K] weight of x's dtype")
    form = NORM if residual is None else NORM_RESIDUAL
    return _launch(form, x, residual, norm_weight, eps, k, qweight, scales, zeros, group_size,
                   blocks, split_k, pairs, stages, tma)


def w4a16_gemv_swiglu(
    gate_up: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, blocks: tuple[int, int, int] | None = None, split_k: int | None = None,
    pairs: bool | None = None, stages: int = 1, tma: bool = False,
) -> torch.Tensor:
    """(silu(gate) * up) @ W for gate_up = [gate | up] [M, 2K]: kernels/silu_mul.py's
    `silu_and_mul` and then `w4a16_gemv`, one launch."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"w4a16_gemv_swiglu: gate_up {tuple(gate_up.shape)}: need [M, 2K]")
    return _launch(SWIGLU, gate_up, None, None, 0.0, gate_up.shape[-1] // 2, qweight, scales,
                   zeros, group_size, blocks, split_k, pairs, stages, tma)[0]


def _launch(
    form: tl.constexpr, x: torch.Tensor, residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None, eps: float, k: int, qweight: torch.Tensor,
    scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    blocks: tuple[int, int, int] | None, split_k: int | None, pairs: bool | None, stages: int,
    tma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the new residual stream: x + residual for NORM_RESIDUAL, else x)."""
    kind = form.value  # a plain int for the launch's arguments
    block_n, max_rows, warps = blocks or default_blocks(k, qweight.shape[-1])
    rows = gemv_rows(group_size, k, max_rows) if group_size > 0 and k % group_size == 0 \
        else None
    check_inputs("w4a16_gemv", x[:, :k] if x.dim() == 2 else x, qweight, scales, zeros,
                 group_size, None if rows is None else 8 * rows[0])
    if tma and (qweight.stride(0) % 4 or qweight.data_ptr() % 16):  # rows contiguous: checked
        raise ValueError(f"w4a16_gemv: tma needs qweight's rows 16-byte aligned, got strides "
                         f"{qweight.stride()}")
    m, n = x.shape[0], qweight.shape[1]
    pairs = _pairs_fit(x, kind, pairs)
    plan = split_k_plan(x, k, 8 * rows[0], (m, triton.cdiv(n, block_n)), split_k,
                        **share_rule((block_n, max_rows, warps)))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if kind == NORM_RESIDUAL.value \
        else x
    computed = x if kind == PLAIN.value else torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m == 0:
        return out, s_out
    parts, counters = plan.workspace(x, n)
    res = x if residual is None else residual
    codes = TensorDescriptor.from_tensor(qweight, [rows[0], block_n]) if tma else qweight
    _w4a16_gemv_kernel[plan.grid](
        x, res, x if norm_weight is None else norm_weight, s_out, computed, qweight, codes,
        scales, zeros, out, parts, counters, m, n, k, group_size, plan.k_per_split, eps,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=block_n, ROWS=rows[0], GROUP_ROWS=rows[1], SPLIT_K=plan.split, FORM=kind,
        PRO_BLOCK=PROLOGUE_BLOCK, PREFETCH=kind != PLAIN.value and x.is_cuda,
        LINES=triton.cdiv(block_n, 32), PAIRS=pairs, PAIRS_ASM=x.is_cuda,
        EVEN_N=n % block_n == 0, STAGES=stages, TMA=tma,
        num_warps=warps,
    )
    return out, s_out


def _pairs_fit(x: torch.Tensor, kind: int, pairs: bool | None) -> bool:
    """Whether the loop multiplies codes in pairs: asked, or by default on CUDA (elsewhere the
    interpreter emulates the packed instructions: tests), where x as the loop reads it is
    16-bit with rows of whole int32 words."""
    words = kind != PLAIN.value or ((x.shape[0] == 1 or x.stride(0) % 2 == 0)
                                    and x.data_ptr() % 4 == 0)
    fits = x.dtype in (torch.bfloat16, torch.float16) and words
    if pairs and not fits:
        raise ValueError(f"w4a16_gemv: pairs needs bf16 or fp16 x with rows of whole int32 "
                         f"words, got {x.dtype}, row stride {x.stride(0)}")
    return fits and x.is_cuda if pairs is None else pairs
