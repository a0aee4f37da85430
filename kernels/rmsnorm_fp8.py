"""RMSNorm (with the residual add before it) that writes its rows quantized per token to FP8:
the input of an FP8 projection's torch._scaled_mm (engine/quant/fp8.py, engine/models/
fp8_inputs.py), in one launch instead of kernels/rmsnorm.py then kernels/fp8_quant.py.

Why: on an H100 trace of W1 (2026-12-05, docs/benchmarks.md "One H100 (2026-12-05): W1 traced,
bf16 and FP8"), quantizing the activations was 0.17 ms of FP8's 2.85 ms decode step at ~250
rows: 64 launches of `_quantize_rows_kernel` a step on the 16-layer 1B model, four a layer.
This kernel takes the ones before qkv_proj and gate_up_proj (kernels/silu_mul_fp8.py the one
before down_proj), and skips writing the normed rows and reading them back.

NOTE: one program per token row, the whole row in registers. It computes exactly what the two
kernels compute, bit for bit: kernels/rmsnorm.py's arithmetic in the same order (same block
and warps, so the same fp32 sum of squares), its output rounded to x's dtype as it would be
stored, then kernels/fp8_quant.py's quantization of that row:

    r = x + residual (rounded, written back)   y = dtype(weight * dtype(r * rsqrt(mean(r^2) + eps)))
    scale = max(amax(|y|) / FP8_MAX, MIN_SCALE)    q = fp8(clamp(y / scale, +-FP8_MAX))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET
from kernels.fp8 import FP8, FP8_MAX, MIN_SCALE, quantize_rows_ref
from kernels.fp8_quant import MAX_BLOCK, store_fp8_row
from kernels.rmsnorm import normed_row, rms_norm_ref

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,  # [T, K] bf16 / fp16 / fp32
    res_ptr,  # [T, K] x's dtype (x itself without a residual: unread)
    w_ptr,  # [K]
    q_ptr,  # [T, K] float8_e4m3fn
    scale_ptr,  # [T] fp32
    res_out_ptr,  # [T, K] x's dtype: x + residual (unwritten without one)
    eps, stride_x, stride_r, stride_q, stride_ro, hidden,
    FP8_LIMIT: tl.constexpr, SCALE_FLOOR: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr, ROUND_FIRST: tl.constexpr,  # the interpreter: see _round_to_e4m3
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    y = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, offs, mask, eps, stride_x, stride_r,
                   stride_ro, hidden, HAS_RESIDUAL).to(tl.float32)  # as quantize_rows reads it
    store_fp8_row(y, q_ptr + row * stride_q, scale_ptr + row, offs, mask, FP8_LIMIT,
                  SCALE_FLOOR, ROUND_FIRST)


def rms_norm_fp8(
    x: torch.Tensor,  # [T, K] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [K]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, K] in x's dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, K] float8_e4m3fn, scale [T, 1] fp32, x + residual [T, K]): bit for bit
    `quantize_rows(rms_norm(x, weight, eps, residual)[0])` and rms_norm's new residual (x itself
    without a residual). Inputs are not modified; rows of another layout are copied first, as
    rms_norm does. Raises ValueError on a shape, dtype or width it does not take."""
    _check(x, weight, residual)
    x_rows = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    num_tokens, hidden = x.shape
    q = torch.empty(num_tokens, hidden, dtype=FP8, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x_rows) if residual is not None else x
    if num_tokens:
        res = residual if residual is not None else x_rows
        _rms_norm_fp8_kernel[(num_tokens,)](
            x_rows, res, weight, q, scale, res_out, eps,
            x_rows.stride(0), res.stride(0), q.stride(0), res_out.stride(0), hidden,
            FP8_LIMIT=FP8_MAX, SCALE_FLOOR=MIN_SCALE, HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden), ROUND_FIRST=INTERPRET,
            num_warps=8 if hidden >= 2048 else 4,  # rms_norm's: the same order of the sum
        )
    return q, scale, res_out


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"rms_norm_fp8 needs x [T, K], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"rms_norm_fp8 takes x in bf16, fp16 or fp32, got {x.dtype}")
    hidden = x.shape[1]
    if hidden > MAX_BLOCK:
        raise ValueError(f"rms_norm_fp8 holds rows of at most {MAX_BLOCK} values, got {hidden}")
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"rms_norm_fp8 needs a contiguous weight [{hidden}], got "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm_fp8 needs the residual in x's shape {tuple(x.shape)} and "
                         f"dtype {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")


def rms_norm_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm in torch (kernels/rmsnorm.py's reference), rounded to x's dtype, quantized per
    row (kernels/fp8.py's reference)."""
    out = rms_norm_ref(x, weight, eps, residual)
    normed, new_residual = (out, x) if residual is None else out
    return (*quantize_rows_ref(normed.to(x.dtype)), new_residual)
