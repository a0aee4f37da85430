"""W4A16 for long steps (prefills): de-quantize W into x's dtype, then one cuBLAS matmul.

A prefill step of thousands of tokens is bound by the matmul's arithmetic, not by reading the
weights: there the in-register de-quantizing GEMM (kernels/w4a16.py) pays its extra
instructions on every tile of every row block, while writing W once in 16 bits (2.5 bytes a
weight of traffic: half a byte read, two written) and handing it to cuBLAS costs a fixed
~microseconds per layer that the matmul's milliseconds hide. vLLM's AWQ layer makes the same
switch at 256 tokens.

NOTE: grid (K / BLOCK_K, N / BLOCK_N). A program reads BLOCK_K / 8 rows of qweight's int32
(BLOCK_N columns), shifts each into its 8 rows of codes, subtracts the group's zeros and
multiplies by its scales (BLOCK_K divides G: one group a program), and stores the [BLOCK_K,
BLOCK_N] tile of W [K, N] in the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.w4a16 import block_k_for, check_inputs

BLOCK_N = 128


@triton.jit
def _dequant_kernel(
    q_ptr,  # [K / 8, N] int32 packed codes
    s_ptr,  # [K / G, N] fp32 scales
    z_ptr,  # [K / G, N] uint8 zeros
    w_ptr,  # [K, N] out, x's dtype
    N,
    group_size,
    stride_qk,
    stride_sg,
    stride_wk,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    k = tl.program_id(0) * BLOCK_K
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, BLOCK_K // 8)
    n_mask = rn < N
    packed = tl.load(q_ptr + (k // 8 + ri)[:, None].to(tl.int64) * stride_qk + rn[None, :],
                     mask=n_mask[None, :], other=0)  # [BK / 8, BN]
    group_row = (k // group_size).to(tl.int64) * stride_sg
    scale = tl.load(s_ptr + group_row + rn, mask=n_mask, other=0.0)
    zero = tl.load(z_ptr + group_row + rn, mask=n_mask, other=0).to(tl.float32)
    shifts = tl.arange(0, 8) * 4
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK / 8, 8, BN]
    w = (tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32) - zero[None, :]) * scale[None, :]
    rk = k + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rk[:, None].to(tl.int64) * stride_wk + rn[None, :],
             w.to(w_ptr.dtype.element_ty), mask=n_mask[None, :])


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` (kernels/w4a16.py's `dequantize_ref`, rounded once to `dtype`)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    block_k = block_k_for(group_size, minimum=8)
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _dequant_kernel[(k // block_k, triton.cdiv(n, BLOCK_N))](
        qweight, scales, zeros, w, n, group_size, qweight.stride(0), scales.stride(0),
        w.stride(0), BLOCK_K=block_k, BLOCK_N=BLOCK_N, num_warps=4,
    )
    return w


def w4a16_dequant_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """[M, K] x the 4-bit W [K, N] -> [M, N] in x's dtype: W de-quantized to x's dtype, then
    `torch.mm`. ValueError for shapes, strides or dtypes it cannot take."""
    block_k = block_k_for(group_size, minimum=8) if group_size > 0 else None
    check_inputs("w4a16_dequant_linear", x, qweight, scales, zeros, group_size, block_k)
    return torch.mm(x, dequantize(qweight, scales, zeros, group_size, x.dtype))
