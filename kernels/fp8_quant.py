"""Per-token FP8 quantization of activations: x [M, K] -> q [M, K] float8_e4m3fn and
scale [M, 1] fp32 with x ~= q * scale (the A operand of torch._scaled_mm's rowwise scaling).

NOTE: grid (rows,). A program holds its whole row in registers: one read of x, a max of |x|,
then q = clamp(x / scale) and the scale written once. Eager torch makes five passes (abs, amax,
divide, clamp, cast) with intermediates between them; at decode sizes (M <= 256) the launches
dominate, and this is one.

    scale = max(amax(|x|) / FP8_MAX, MIN_SCALE)        (vLLM's floor: an all-zero row stays 0)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET
from kernels.fp8 import FP8, FP8_MAX, MIN_SCALE

MAX_BLOCK = 32768  # the widest row one program holds


@triton.jit
def _round_to_e4m3(v):
    """fp32 -> the nearest float8_e4m3fn value (ties to even), still fp32: the interpreter's
    fp32 -> fp8 cast drops a rounding carry (124.2 -> 64), so there the cast gets exact input.
    Normal e4m3 (|v| >= 2^-6) keeps 3 of fp32's 23 mantissa bits; below, steps of 2^-9."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    tiny = ((v * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5 * 2^23: rounds to an integer
    return tl.where(tl.abs(v) >= 0.015625, normal, tiny)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    q_ptr,  # [M, K] float8_e4m3fn
    scale_ptr,  # [M] fp32
    K,
    stride_x,
    stride_q,
    FP8_LIMIT: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # the interpreter: see _round_to_e4m3
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    store_fp8_row(x, q_ptr + row * stride_q, scale_ptr + row, offs, mask, FP8_LIMIT,
                  SCALE_FLOOR, ROUND_FIRST)


@triton.jit
def store_fp8_row(
    x,  # [BLOCK] fp32: one row, zeros past its end
    q_row_ptr,  # [K] float8_e4m3fn: the row's codes
    scale_row_ptr,  # [1] fp32: the row's scale
    offs, mask,
    FP8_LIMIT: tl.constexpr, SCALE_FLOOR: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    """One row quantized per token and stored (the module's NOTE); also the epilogue of the
    kernels that make the row (kernels/rmsnorm_fp8.py, kernels/silu_mul_fp8.py)."""
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(tl.div_rn(amax, FP8_LIMIT), SCALE_FLOOR)  # IEEE divisions: as torch's
    q = tl.clamp(tl.div_rn(x, scale), -FP8_LIMIT, FP8_LIMIT)
    if ROUND_FIRST:
        q = _round_to_e4m3(q)
    tl.store(q_row_ptr + offs, q.to(q_row_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_row_ptr, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32); see `quantize_rows_ref`."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows needs [M, K] with contiguous rows, got {tuple(x.shape)}")
    rows, width = x.shape
    if width > MAX_BLOCK:
        raise ValueError(f"quantize_rows holds rows of at most {MAX_BLOCK} values, got {width}")
    q = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(width)
        _quantize_rows_kernel[(rows,)](
            x, q, scale, width, x.stride(0), q.stride(0), FP8_LIMIT=FP8_MAX,
            SCALE_FLOOR=MIN_SCALE, BLOCK=block, ROUND_FIRST=INTERPRET,
            num_warps=min(16, max(1, block // 512)),
        )
    return q, scale
