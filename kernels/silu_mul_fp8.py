"""SiLU-and-mul (SwiGLU) that writes its rows quantized per token to FP8: the input of an FP8
down_proj's torch._scaled_mm (engine/quant/fp8.py, engine/models/fp8_inputs.py), in one launch
instead of kernels/silu_mul.py then kernels/fp8_quant.py.

Why: on an H100 trace of W1 (2026-12-05, docs/benchmarks.md "One H100 (2026-12-05): W1 traced,
bf16 and FP8"), quantizing the activations was 0.17 ms of FP8's 2.85 ms decode step at ~250
rows: 64 launches of `_quantize_rows_kernel` a step on the 16-layer 1B model, four a layer.
This kernel takes the one before down_proj (kernels/rmsnorm_fp8.py those before qkv_proj and
gate_up_proj), and skips writing the [T, I] activations and reading them back.

NOTE: one program per token row, the whole row of I values in registers (quantization needs
the row's amax; kernels/silu_mul.py tiles the columns instead). Bit for bit the two kernels:
silu_mul's expression in fp32 rounded to x's dtype, then fp8_quant's quantization of it:

    y = dtype(silu(gate) * up)    scale = max(amax(|y|) / FP8_MAX, MIN_SCALE)
    q = fp8(clamp(y / scale, +-FP8_MAX))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET
from kernels.fp8 import FP8, FP8_MAX, MIN_SCALE, quantize_rows_ref
from kernels.fp8_quant import MAX_BLOCK, store_fp8_row
from kernels.silu_mul import silu_and_mul_ref, swiglu_cols

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _silu_mul_fp8_kernel(
    x_ptr,  # [T, 2I] bf16 / fp16 / fp32: gate in columns [0, I), up in [I, 2I)
    q_ptr,  # [T, I] float8_e4m3fn
    scale_ptr,  # [T] fp32
    stride_x, stride_q, width,
    FP8_LIMIT: tl.constexpr, SCALE_FLOOR: tl.constexpr, BLOCK: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # the interpreter: see _round_to_e4m3
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    out = swiglu_cols(x_ptr, row, offs, mask, stride_x, width)
    y = out.to(x_ptr.dtype.element_ty).to(tl.float32)  # as silu_mul stores it, as read back
    store_fp8_row(y, q_ptr + row * stride_q, scale_ptr + row, offs, mask, FP8_LIMIT,
                  SCALE_FLOOR, ROUND_FIRST)


def silu_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2I] -> (q [T, I] float8_e4m3fn, scale [T, 1] fp32): bit for bit
    `quantize_rows(silu_and_mul(x))`. Raises ValueError on a shape, layout, dtype or width it
    does not take."""
    _check(x)
    num_tokens, width = x.shape[0], x.shape[1] // 2
    q = torch.empty(num_tokens, width, dtype=FP8, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(width)
        _silu_mul_fp8_kernel[(num_tokens,)](
            x, q, scale, x.stride(0), q.stride(0), width, FP8_LIMIT=FP8_MAX,
            SCALE_FLOOR=MIN_SCALE, BLOCK=block, ROUND_FIRST=INTERPRET,
            num_warps=min(16, max(1, block // 512)),
        )
    return q, scale


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul_fp8 needs gate_up [T, 2I], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("silu_mul_fp8 needs contiguous rows")
    if x.dtype not in DTYPES:
        raise ValueError(f"silu_mul_fp8 takes bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[1] // 2 > MAX_BLOCK:
        raise ValueError(f"silu_mul_fp8 holds rows of at most {MAX_BLOCK} values, got "
                         f"{x.shape[1] // 2}")


def silu_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU in torch (kernels/silu_mul.py's reference), quantized per row (kernels/fp8.py's)."""
    return quantize_rows_ref(silu_and_mul_ref(x))
