"""FP8 x FP8 decode GEMV on tensor cores (W8A8): y [M, N] = (xq [M, K] @ Wq [N, K]^T) * sx * sw.

NOTE: grid (cdiv(N, BLOCK_N), SPLIT_K). The FP8-weight GEMV of kernels/gemv.py widens every
weight to fp32 before its multiply-add, and on an H100 that conversion, not DRAM, bounds it
(the FP8 GEMV moved 0.79-0.91 of the bf16 GEMV's bytes/s; pdserve/bench/gpu_fp8_gemv.py).
Tensor cores take
fp8 codes as they are: with x quantized per token to fp8 as well (as torch._scaled_mm's rowwise
path does for larger batches, engine/quant/fp8.py), the weights go from memory into an
fp8 x fp8 -> fp32 dot with no per-weight instruction. The dot's rows are W's rows (BLOCK_N of
them), its columns the M <= 16 tokens padded to 16 (the padded rows of xq load as zeros): the
batch is the narrow side ("swap AB"), so tiles stay small along N and there are many programs.
A K loop of dots is what Triton software-pipelines (NUM_STAGES loads in flight per program).
With SPLIT_K > 1 each program takes a K / SPLIT_K range and adds its fp32 partial sums
atomically into a zeroed fp32 output (more programs for the narrow shapes).

    acc[n, m] = sum_k Wq[n, k] * xq[m, k]          (fp8 products, fp32 sums, on tensor cores)
    y[m, n]   = acc[n, m] * sw[n] * sx[m] (+ b[n]), rounded once to the output dtype

K must be a multiple of BLOCK_K * SPLIT_K (the launcher checks it); rows past N clamp to N - 1
for the loads and are dropped at the store.

Measured on an H100 (docs/benchmarks.md, FP8 weights; `python -m pdserve.bench.gpu_fp8_gemv
--dot-only`), M = 1 over 16 layers of the 1B shapes, x already quantized: it beats the widening
GEMV only on the wide gate_up (13.6 vs ~15.7 us) and loses on qkv (6.1 vs ~4.3) and down (10.6
at best, split K, vs ~8.3); quantizing x costs another ~2 us launch. So the engine does not use
it: the FP8 decode path stays kernels/gemv.py's W8A16. Kept as the measured alternative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8

DOT_MAX_TOKENS = 16  # the dot's narrow side
MIN_BLOCK_K = 32  # an fp8 dot's shortest K


@triton.jit
def _fp8_dot_gemv_kernel(
    xq_ptr,  # [M, K] float8_e4m3fn, rows contiguous
    sx_ptr,  # [M] fp32 per-token scales
    w_ptr,  # [N, K] float8_e4m3fn, rows contiguous
    sw_ptr,  # [N] fp32 per-row scales
    b_ptr,  # [N] bias (unused unless HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    rm = tl.arange(0, 16)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_rows = xq_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [16, 1]
    x_mask = rm[:, None] < M
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    k_len = K // SPLIT_K
    k0 = tl.program_id(1) * k_len
    for k in tl.range(k0, k0 + k_len, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows + (k + rk)[None, :])  # [BN, BK] fp8
        x = tl.load(x_rows + (k + rk)[None, :], mask=x_mask, other=0.0)  # [16, BK] fp8
        acc = tl.dot(w, tl.trans(x), acc)
    y = acc * tl.load(sw_ptr + tl.minimum(rn, N - 1))[:, None]
    y *= tl.load(sx_ptr + rm, mask=rm < M, other=0.0)[None, :]
    if HAS_BIAS:  # added once, by the first split
        bias = tl.load(b_ptr + tl.minimum(rn, N - 1)).to(tl.float32)[:, None]
        y += tl.where(tl.program_id(1) == 0, bias, 0.0)
    out = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
    mask = (rm[None, :] < M) & (rn[:, None] < N)
    if SPLIT_K == 1:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # fp32 partial sums into a zeroed output
        tl.atomic_add(out, y, mask=mask)


def fp8_dot_gemv_supports(xq: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    return (xq.dim() == 2 and 0 < xq.shape[0] <= DOT_MAX_TOKENS and weight.dim() == 2
            and xq.dtype == weight.dtype == FP8 and xq.shape[1] == weight.shape[1]
            and block_k >= MIN_BLOCK_K and xq.shape[1] % block_k == 0
            and xq.stride(-1) == 1 and weight.stride(-1) == 1)


def fp8_dot_gemv(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
    block_n: int = 32, block_k: int = 256, num_warps: int = 4, num_stages: int = 4,
    split_k: int = 1,
) -> torch.Tensor:
    """xq [M, K] fp8 with x_scale [M] (or [M, 1]) fp32, weight [N, K] fp8 with w_scale [N]
    fp32 -> [M, N] in out_dtype, M <= DOT_MAX_TOKENS (kernels/fp8.py `scaled_mm_ref`).
    `split_k` > 1: that many programs per row tile, each over K / split_k, adding fp32
    partial sums atomically into a zeroed fp32 output (out_dtype must be float32)."""
    if split_k > 1 and out_dtype != torch.float32:
        raise ValueError("fp8_dot_gemv: split_k > 1 adds fp32 partial sums: out_dtype float32")
    if not fp8_dot_gemv_supports(xq, weight, block_k * split_k):
        raise ValueError(
            f"fp8_dot_gemv: x {tuple(xq.shape)} {xq.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: need fp8 [M <= {DOT_MAX_TOKENS}, K] and [N, K], contiguous rows, "
            f"K a multiple of BLOCK_K {block_k} (>= {MIN_BLOCK_K})"
        )
    (m, k), n = xq.shape, weight.shape[0]
    x_scale = x_scale.reshape(m)
    if x_scale.dtype != torch.float32 or w_scale.shape != (n,) or w_scale.dtype != torch.float32:
        raise ValueError("fp8_dot_gemv: scales must be fp32, x_scale [M], w_scale [N]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_dot_gemv: bias {tuple(bias.shape)}, expected ({n},)")
    out = (torch.zeros if split_k > 1 else torch.empty)(m, n, dtype=out_dtype, device=xq.device)
    _fp8_dot_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        xq, x_scale, weight, w_scale, weight if bias is None else bias, out, m, n, k,
        xq.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, NUM_STAGES=num_stages,
        SPLIT_K=split_k, num_warps=num_warps,
    )
    return out
