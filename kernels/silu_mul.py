"""SiLU-and-mul (SwiGLU) on a fused gate_up projection: out = silu(gate) * up.

NOTE: grid (tokens, column tiles); gate is the first half of each row, up the second. Computed in
fp32 and rounded once: one read of [T, 2I] and one write of [T, I], where eager torch makes a
silu pass and a multiply pass with an intermediate in between.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    out = swiglu_cols(x_ptr, row, offs, mask, stride_x, width)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_cols(x_ptr, row, offs, mask, stride_x, width):
    """silu(gate) * up of row `row`'s columns `offs`, in fp32 (the module's NOTE); also the
    prologue of kernels/silu_mul_fp8.py."""
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + offs, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    num_tokens, width = x.shape[0], x.shape[1] // 2
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs contiguous rows")
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if num_tokens:
        _silu_mul_kernel[(num_tokens, triton.cdiv(width, block))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
