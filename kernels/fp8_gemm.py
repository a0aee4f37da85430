"""FP8 x FP8 GEMM on tensor cores with per-token and per-channel scales, split K for few tiles:

    y [M, N] = (xq [M, K] * x_scale [M, 1]) @ (wq [N, K] * w_scale [N])^T

xq quantized per token (kernels/fp8_quant.py), wq per output channel (engine/quant/fp8.py); the
reference is kernels/fp8.py `scaled_mm_ref`. Measured against torch._scaled_mm by
pdserve/bench/gpu_quant_gemm.py (variants fp8_triton, fp8_triton_best); Fp8Linear does not use
it yet: it is wired in only once a GPU has timed it faster.

NOTE: the fp8 tiles go to `tl.dot` as they are (on sm_89 / sm_90 Triton lowers an fp8e4nv dot
to the fp8 tensor cores, wgmma on Hopper, with both operands K-major in shared memory: x's rows
and W's rows are both contiguous along K, W's tile is transposed in registers, no copy). The
products are summed in fp32 (on sm_90 Triton's default for fp8 dots is the fast accumulation of
torch._scaled_mm(use_fast_accum=True): no periodic promotion inside the tensor core). The
scales are constant along K, so they multiply the accumulator once, after the K loop:

    acc[m, n] = sum_k xq[m, k] * wq[n, k];      y[m, n] = acc[m, n] * sx[m] * sw[n]

Grid (M tiles x N tiles, 1, SPLIT_K). The tiles are taken in groups of GROUP_M row tiles down one
column tile before the next column (consecutive programs share W's and x's tiles in L2). Rows past
M or N read row M - 1 / N - 1 (no load masks along M and N) and are dropped at the store; only the
last K step is masked, and only where BLOCK_K does not divide K (EVEN_K).

Split K: at 256 tokens down_proj (K 8192, N 2048) has 2 x 16 = 32 tiles of 128 x 128 for 132 SMs,
each walking 64 K steps: three quarters of the GPU idle. With SPLIT_K shares each program walks
a K range of whole steps (the last share may be shorter) and stores its scaled fp32 part in a
workspace [SPLIT_K, M, N]; it then takes a ticket on its tile (an atomic add), and the last share
of the tile to arrive sums the parts in share order and writes y in the out dtype, leaving the
ticket 0 (kernels/w4a16.py `store_split_k`, shared with the W4A16 GEMM). Chosen over
`tl.atomic_add` into a zeroed fp32 buffer, which needs a memset before and a cast kernel after
(three launches where the small shapes are launch-bound, ~2 us each) and sums in arrival order
(not bit-reproducible), and over a second reduction kernel (two launches). The workspace is a
torch.empty on the current stream and the tickets one buffer per device kept at 0 by every call:
no host sync, CUDA-graph capturable (make the first split call before a capture: it allocates the
tickets). Each share scales its own part (the same sum up to fp32 rounding).

Under TRITON_INTERPRET=1 (CPU tests) the interpreter cannot take fp8 dots: UPCAST widens both
tiles to fp32 first (exact: an fp8 value has 4 significant bits) and the dot is an fp32 one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET
from kernels.fp8 import FP8
from kernels.w4a16 import SplitKPlan, grouped_tile, sm_count, store_split_k

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_BLOCK_K = 32  # an fp8 tensor-core dot's shortest K
MAX_SPLIT_K = 8
MIN_STEPS_PER_SHARE = 4  # the default split leaves each share at least this many K steps


@triton.jit
def _fp8_gemm_kernel(
    xq_ptr,  # [M, K] float8_e4m3fn, rows contiguous
    sx_ptr,  # [M] fp32 per-token scales (x_scale [M, 1]: row stride stride_sm)
    w_ptr,  # [N, K] float8_e4m3fn, rows contiguous
    sw_ptr,  # [N] fp32 per-output-channel scales, contiguous
    out_ptr,  # [M, N] out dtype, rows contiguous
    part_ptr,  # [SPLIT_K, M, N] fp32 workspace (unused if SPLIT_K == 1)
    ticket_ptr,  # [>= M tiles * N tiles] int32 arrival counters, left 0 (unused if SPLIT_K == 1)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_sm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # BLOCK_K divides K: no K masks
    UPCAST: tl.constexpr,  # widen the fp8 tiles to fp32 before the dot (the interpreter)
    IMPRECISE_ACC: tl.constexpr,  # > 0: the tensor cores' sum moved to fp32 every this many K
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = xq_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_stop, BLOCK_K):
        kk = (k + rk)[None, :]  # [1, BK]
        if EVEN_K:
            x = tl.load(x_rows + kk)  # [BM, BK] fp8
            w = tl.load(w_rows + kk)  # [BN, BK] fp8
        else:  # only a share's last step can pass K (shares are whole steps)
            x = tl.load(x_rows + kk, mask=kk < K, other=0.0)
            w = tl.load(w_rows + kk, mask=kk < K, other=0.0)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
        elif IMPRECISE_ACC > 0:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(x, tl.trans(w), acc)  # fp8 x fp8 -> fp32 on the tensor cores
    sx = tl.load(sx_ptr + tl.minimum(rm, M - 1).to(tl.int64) * stride_sm)  # [BM]
    sw = tl.load(sw_ptr + tl.minimum(rn, N - 1))  # [BN]
    acc = acc * sx[:, None] * sw[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    parts = part_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    store_split_k(acc, out, mask, parts, M * N, ticket_ptr + tl.program_id(0), SPLIT_K)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """A launch of the kernel: output tile BLOCK_M x BLOCK_N, K step, K shares (SPLIT_K, at most
    the K steps), warps, software-pipeline stages, row tiles a group (see NOTE)."""

    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    group_m: int = 8
    # > 0: the tensor cores' running sum is added into an fp32 accumulator every this many K
    # (tl.dot's max_num_imprecise_acc; use_fast_accum=False's promotion), 0: Triton's default
    imprecise_acc: int = 0

    def __post_init__(self) -> None:
        for name, least in (("block_m", 16), ("block_n", 16), ("block_k", MIN_BLOCK_K),
                            ("warps", 1)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"Fp8GemmConfig: {name} {value} is not a power of two >= {least}")
        for name in ("split_k", "stages", "group_m"):
            if getattr(self, name) < 1:
                raise ValueError(f"Fp8GemmConfig: {name} {getattr(self, name)} is below 1")
        if not 0 <= self.imprecise_acc <= self.block_k:
            raise ValueError(f"Fp8GemmConfig: imprecise_acc {self.imprecise_acc} is not in "
                             f"0..block_k ({self.block_k})")

    @property
    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}k{self.split_k}"
                f"w{self.warps}s{self.stages}"
                + (f"a{self.imprecise_acc}" if self.imprecise_acc else ""))


def default_config(m: int, n: int, k: int, sm_count: int) -> Fp8GemmConfig:
    """The launch for [M, K] x [N, K] on `sm_count` SMs (1 on the CPU: no split).

    64-row tiles up to 64 tokens (a wgmma's height; 4 warps, 4 stages), 128 x 128 above (8 warps,
    3 stages); 128 x 128 output columns and a K step of 128 (16 KiB of fp8 per operand a stage).
    Split K only where the tiles leave SMs idle: as many shares as keep the programs within one
    wave (SMs // tiles), at most MAX_SPLIT_K and at least MIN_STEPS_PER_SHARE K steps a share.
    A guess to be checked by pdserve/bench/gpu_quant_gemm.py's fp8_triton_best (not yet timed)."""
    block_m, warps, stages = (64, 4, 4) if m <= 64 else (128, 8, 3)
    tiles = triton.cdiv(max(m, 1), block_m) * triton.cdiv(n, 128)
    steps = triton.cdiv(k, 128)
    split = max(1, min(sm_count // tiles, steps // MIN_STEPS_PER_SHARE, MAX_SPLIT_K))
    return Fp8GemmConfig(block_m, 128, 128, split, warps, stages)


def check_inputs(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                 w_scale: torch.Tensor, out_dtype: torch.dtype) -> None:
    """ValueError naming the first operand the kernel cannot take."""
    if xq.dim() != 2 or wq.dim() != 2 or xq.dtype != FP8 or wq.dtype != FP8:
        raise ValueError(f"fp8_gemm: xq {tuple(xq.shape)} {xq.dtype}, wq {tuple(wq.shape)} "
                         f"{wq.dtype}: need 2-D float8_e4m3fn [M, K] and [N, K]")
    (m, k), (n, k_w) = xq.shape, wq.shape
    if k != k_w or k == 0:
        raise ValueError(f"fp8_gemm: xq [M, K] {tuple(xq.shape)} and wq [N, K] "
                         f"{tuple(wq.shape)} need the same K > 0")
    if xq.stride(-1) != 1 or wq.stride(-1) != 1:
        raise ValueError(f"fp8_gemm: xq strides {xq.stride()}, wq strides {wq.stride()}: "
                         "rows must be contiguous")
    if x_scale.dtype != torch.float32 or tuple(x_scale.shape) not in ((m, 1), (m,)):
        raise ValueError(f"fp8_gemm: x_scale {tuple(x_scale.shape)} {x_scale.dtype}: need "
                         f"[{m}, 1] float32")
    if w_scale.dtype != torch.float32 or w_scale.shape != (n,) or w_scale.stride(0) != 1:
        raise ValueError(f"fp8_gemm: w_scale {tuple(w_scale.shape)} {w_scale.dtype} strides "
                         f"{w_scale.stride()}: need contiguous [{n}] float32")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"fp8_gemm: out_dtype {out_dtype}: need one of {OUT_DTYPES}")
    if len({t.device for t in (xq, x_scale, wq, w_scale)}) != 1:
        raise ValueError("fp8_gemm: xq, x_scale, wq and w_scale must be on one device")


def split_plan(m: int, n: int, k: int, config: Fp8GemmConfig) -> SplitKPlan:
    """The launch's tiles and K in at most `config.split_k` shares of whole BLOCK_K steps."""
    tiles = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    return SplitKPlan.whole_steps(k, config.block_k, tiles, config.split_k)


def fp8_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """xq [M, K] fp8 with x_scale [M, 1] (or [M]) fp32, wq [N, K] fp8 with w_scale [N] fp32 ->
    y [M, N] in out_dtype (bf16, fp16 or fp32); kernels/fp8.py `scaled_mm_ref`. `config`: the
    launch, by default `default_config` for this shape and device. Allocates y and, with split
    K, an fp32 workspace [shares, M, N] (torch.empty); ValueError for operands it cannot take."""
    check_inputs(xq, x_scale, wq, w_scale, out_dtype)
    (m, k), n = xq.shape, wq.shape[0]
    config = config or default_config(m, n, k, sm_count(xq.device))
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    plan = split_plan(m, n, k, config)
    if plan.split * m * n >= 2**31:  # the workspace's offsets are int32 in store_split_k
        raise ValueError(f"fp8_gemm: {plan.split} K shares of [{m}, {n}] overflow int32")
    parts, counters = plan.workspace(xq, n)  # (xq, xq) unused with one share
    _fp8_gemm_kernel[plan.flat_grid](
        xq, x_scale, wq, w_scale, out, parts, counters, m, n, k, plan.k_per_split,
        xq.stride(0), x_scale.stride(0), wq.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, SPLIT_K=plan.split, EVEN_K=k % config.block_k == 0,
        UPCAST=INTERPRET, IMPRECISE_ACC=config.imprecise_acc, num_warps=config.warps,
        num_stages=config.stages,
    )
    return out
