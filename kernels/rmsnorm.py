"""RMSNorm, optionally fused with the residual add before it.

NOTE: one program per token row. With a residual: r = x + residual (rounded to the input dtype,
as an unfused add would be, and written back as the new residual), then
out = weight * (r * rsqrt(mean(r^2) + eps)), normalised in fp32 and cast to the input dtype
before the weight multiply: transformers' LlamaRMSNorm op order, so fp32 results agree with HF.
One pass over the row instead of the three-plus an eager add/pow/mean/mul chain makes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro, hidden,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    out = normed_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, offs, mask, eps, stride_x,
                     stride_r, stride_ro, hidden, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


@triton.jit
def normed_row(
    x_ptr, res_ptr, w_ptr, res_out_ptr, row, offs, mask, eps, stride_x, stride_r, stride_ro,
    hidden, HAS_RESIDUAL: tl.constexpr,
):
    """One row's norm (the module's NOTE) in x's dtype; with a residual, x + residual stored
    as the row's new residual. Also the prologue of kernels/rmsnorm_fp8.py."""
    dtype = x_ptr.dtype.element_ty
    # 16-bit sums and products are done in fp32 and rounded: the same result as a correctly
    # rounded 16-bit op, and what the CPU interpreter (no native bf16 arithmetic) computes right.
    x32 = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x32 += tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x32 = x32.to(dtype).to(tl.float32)
        tl.store(res_out_ptr + row * stride_ro + offs, x32.to(dtype), mask=mask)
    variance = tl.sum(x32 * x32, 0) / hidden
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (w * normed).to(dtype)


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out, or (out, x + residual) when a residual is given. Inputs are not modified. Rows are
    read with a stride but each row must be contiguous: other layouts are copied first (a
    transposed view's `empty_like` would be transposed too)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        res = residual if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, res_out, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), hidden,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
            num_warps=8 if hidden >= 2048 else 4,
        )
    return out if residual is None else (out, res_out)


def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return out if residual is None else (out, x)
