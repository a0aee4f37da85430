"""FP8 (float8_e4m3fn) matmuls: the obviously correct torch references of the Triton kernels
(fp8_quant.py, fp8_w8a16.py) and the launcher of torch._scaled_mm (Hopper / Ada tensor cores).

Weights W [N, K] are stored in fp8 with one fp32 scale per output channel: W ~= Wq * s_w[:, None].
Activations are quantized per token (per row of x) at run time: x ~= xq * s_x[:, None]. Then

    y = x W^T ~= (xq Wq^T) * s_x[:, None] * s_w[None, :]

which `torch._scaled_mm` computes with rowwise scales in one GEMM (fp8 x fp8 -> fp32 accumulate
-> bf16). Where it cannot run, the W8A16 kernel de-quantizes W in registers and keeps x as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor of a dynamic activation scale


# ---- references ----------------------------------------------------------------------------------
def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q [M, K] fp8, scale [M, 1] fp32), dynamic per row (kernels/fp8_quant.py)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static_ref(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] with one fp32 scale (a checkpoint's `input_scale`) -> (q, scale [M, 1])."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def dequantize_weight(
    qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [N, K] fp8, [N] fp32 -> [N, K] in dtype
    return (qweight.to(torch.float32) * scale[:, None]).to(dtype)


def w8a16_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:  # [M, K] x [N, K] fp8 -> [M, N] in x's dtype (kernels/fp8_w8a16.py)
    return F.linear(x.float(), dequantize_weight(qweight, scale, torch.float32)).to(x.dtype)


def scaled_mm_ref(
    xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, K] fp8, [M, 1], [N, K] fp8, [N] -> [M, N] out_dtype (`scaled_mm`)
    y = (xq.float() @ qweight.float().t()) * x_scale * w_scale[None, :]
    return y.to(out_dtype)


def scaled_mm_magnitude(
    xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
) -> torch.Tensor:  # [M, N] fp32: sum_k |xq w| scaled, as `scaled_mm_ref`'s operands
    """What an accumulator's rounding in `scaled_mm` is bounded by: the sum of the products'
    magnitudes (the result itself can be small by cancellation)."""
    return (xq.float().abs() @ qweight.float().abs().t()) * x_scale * w_scale[None, :]


# ---- torch._scaled_mm ----------------------------------------------------------------------------
def scaled_mm_supported(device: torch.device, in_features: int, out_features: int) -> bool:
    """Whether `scaled_mm` runs here: a CUDA device of compute capability >= 8.9 (fp8 tensor
    cores) and both dims multiples of 16 (cuBLASLt / CUTLASS alignment)."""
    if device.type != "cuda" or in_features % 16 or out_features % 16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(
    xq: torch.Tensor,  # [M, K] fp8, contiguous rows
    x_scale: torch.Tensor,  # [M, 1] fp32
    qweight: torch.Tensor,  # [N, K] fp8, contiguous rows (its transpose is column-major)
    w_scale_row: torch.Tensor,  # [1, N] fp32
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [M, N]
    # fast accumulation (no periodic promotion of the fp8 products' sums to fp32 inside the
    # kernel, as vLLM's CUTLASS FP8 GEMMs on Hopper): 5-16% faster from 1k tokens on an H200,
    # the same error against the fp32 product (docs/benchmarks.md)
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=w_scale_row,
                            out_dtype=out_dtype, use_fast_accum=True)
