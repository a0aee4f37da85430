"""FP8 weights (float8_e4m3fn, one fp32 scale per output channel) and the linear layer over them.

`quantize_weight` is the repository's quantizer (vLLM's per-channel scheme): a bf16 / fp16 /
fp32 checkpoint is quantized on load by `Fp8Linear`, an FP8 checkpoint arrives as `Fp8Weight`
(engine/quant/fp8_checkpoint.py), a per-tensor scale spread over the rows (exact). Activations
are quantized per token at run time, or with the checkpoint's static `input_scale`.

Where `Fp8Linear` computes (the weights stay fp8 everywhere; half the bytes of bf16):

    CUDA, steps of <= 4 tokens (batch-1 decode)     the decode GEMVs where the load planned
                                                    them (engine/models/gemv_plan.py: with the
                                                    RMSNorm / SwiGLU fusions, as for bf16),
                                                    else the FP8-weight GEMV (kernels/fp8_gemv.py)
    CUDA, steps of <= W8A16_MAX_TOKENS tokens,      W8A16 Triton GEMM (kernels/fp8_w8a16.py):
    activations scaled per token at run time        x kept in bf16 (faster there, and exact)
    CUDA, capability >= 8.9, bf16, dims % 16 == 0   per-token fp8 x (kernels/fp8_quant.py,
                                                    or by the norm / SwiGLU kernel making x:
                                                    engine/models/fp8_inputs.py),
                                                    torch._scaled_mm with rowwise scales
    other CUDA                                      W8A16 Triton GEMM (kernels/fp8_w8a16.py)
    CPU                                             de-quantize W into x's dtype, F.linear: in
                                                    fp32 exactly the de-quantized model
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8 import (
    FP8,
    FP8_MAX,
    dequantize_weight,
    quantize_static_ref,
    scaled_mm,
    scaled_mm_supported,
)

FP8_METHOD = "fp8"
# Up to this many tokens the W8A16 GEMM beat per-token quantization + torch._scaled_mm on every
# 1B projection on an H200 (8 and 16 tokens: 6.6-7.1 against 9.7-9.9 us for qkv and o, 14.2-23.0
# against 15.0-24.1 for gate_up and down) and lost from 32 (docs/benchmarks.md); its error is
# bf16's (1.7e-3 against the fp8 weights' product, 2.7e-2 with fp8 activations). Checkpoints
# with a static input scale keep their W8A8 arithmetic.
W8A16_MAX_TOKENS = 16


@dataclass
class Fp8Weight:
    """Rows of an FP8 weight: `qweight` [rows, in] float8_e4m3fn, `scale` [rows] fp32 (per
    output channel), `input_scale` a static activation scale (fp32 scalar) or None (dynamic)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """[out, in] bf16 / fp16 / fp32 -> per-output-channel FP8: scale = amax(|row|) / 448 (rows
    of zeros get scale 1), computed in fp32 on the weight's device."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    qweight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(qweight, scale)


def dequantize(weight: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the FP8 one stands for, [out, in] in `dtype` (what the CPU path multiplies)."""
    return dequantize_weight(weight.qweight, weight.scale, dtype)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b), W [out, in] in FP8 with per-output-channel scales (one rank).

    Like the GGUF layers it has an empty `weight` parameter (its dtype: the model's, set by
    `.to`) whose `weight_loader` takes rows `rows` of the whole matrix, fused q/k/v and gate/up
    arriving as row ranges: an `Fp8Weight`, or a dense tensor quantized on arrival (on this
    layer's device). Fused shards with static input scales share their largest (vLLM's rule).
    `fused_inputs`: whether the norm / SwiGLU before it may hand it rows already quantized
    (engine/models/fp8_inputs.py); off, each projection quantizes its own
    (pdserve/bench/gpu_quant.py system fp8_unfused turns it off: W1 on an H100, 2026-12-07,
    55.7k out tok/s fused against 52.2k, medians of three runs, docs/benchmarks.md).
    """

    fused_inputs = True
    # The quantized rows' product by kernels/fp8_gemm.py (Triton, K split where the tiles leave
    # SMs idle) instead of torch._scaled_mm: off until a GPU has timed it faster end to end
    # (pdserve/bench/gpu_quant.py system fp8_triton turns it on).
    triton_gemm = False

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.weight.weight_loader = self._load
        self.weight.loads_shards = True  # takes fused q/k/v and gate/up rows itself
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.qweight: torch.Tensor | None = None  # [out, in] fp8, filled row range by range
        self.weight_scale: torch.Tensor | None = None  # [out] fp32
        self.scale_row: torch.Tensor | None = None  # [1, out] fp32, for torch._scaled_mm
        self.input_scale: torch.Tensor | None = None  # [] fp32: static activations
        self._static: set[bool] = set()  # whether each shard came with an input scale
        self.use_scaled_mm = False

    def _load(self, param: nn.Parameter, rows: slice, tensor: object, name: str) -> None:
        start, stop, _ = rows.indices(self.out_features)
        part = self._as_fp8(tensor, name)
        if tuple(part.shape) != (stop - start, self.in_features):
            raise ValueError(f"weight {name!r} has shape {tuple(part.shape)}, expected "
                             f"{(stop - start, self.in_features)}")
        if self.qweight is None:
            self._allocate()
        self.qweight[start:stop] = part.qweight.to(self.qweight.device)
        self.weight_scale[start:stop] = part.scale.to(self.weight_scale.device)
        self.scale_row = self.weight_scale.view(1, -1)
        self._add_input_scale(part.input_scale, name)

    def _as_fp8(self, tensor: object, name: str) -> Fp8Weight:
        if isinstance(tensor, Fp8Weight):
            return tensor
        if not isinstance(tensor, torch.Tensor) or tensor.dtype == FP8:
            raise ValueError(f"weight {name!r}: an FP8 layer takes a dense tensor or an "
                             f"Fp8Weight (fp8 values with their scales), got {type(tensor)}")
        return quantize_weight(tensor.to(self.weight.device))

    def _allocate(self) -> None:
        device = self.weight.device
        self.qweight = torch.empty(self.out_features, self.in_features, dtype=FP8, device=device)
        self.weight_scale = torch.empty(self.out_features, dtype=torch.float32, device=device)
        self.use_scaled_mm = (self.weight.dtype == torch.bfloat16 and scaled_mm_supported(
            device, self.in_features, self.out_features))
        # what the decode GEMVs read with the codes (engine/models/tp_layers.py `gemv_scale`)
        self.qweight.gemv_scale = self.weight_scale
        self.qweight.gemv_act_dtype = self.weight.dtype

    @property
    def gemv_weight(self) -> torch.Tensor | None:
        """The codes the decode GEMVs stream (engine/models/tp_layers.py `gemv_weight`)."""
        return self.qweight

    def _add_input_scale(self, scale: torch.Tensor | None, name: str) -> None:
        self._static.add(scale is not None)
        if len(self._static) > 1:
            raise ValueError(f"weight {name!r}: some fused shards have a static input_scale "
                             "and others none (FP8 checkpoint)")
        if scale is not None:
            scale = scale.float().reshape(()).to(self.weight.device)
            old = self.input_scale
            self.input_scale = scale if old is None else torch.maximum(old, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return F.linear(x, dequantize_weight(self.qweight, self.weight_scale, x.dtype))
        from engine.models.tp_layers import dense_linear
        from kernels.fp8_gemv import GEMV_MAX_TOKENS
        from kernels.fp8_quant import quantize_rows
        from kernels.fp8_w8a16 import w8a16_linear

        x = x.contiguous()
        if x.shape[0] <= GEMV_MAX_TOKENS:  # the planned GEMV, or kernels/fp8_gemv.py
            return dense_linear(x, self.qweight)
        if self.takes_fp8_rows(x.shape[0], x.device, x.dtype):
            return self._rows_mm(*quantize_rows(x))
        if not self.use_scaled_mm or x.dtype != torch.bfloat16 or self.input_scale is None:
            return w8a16_linear(x, self.qweight, self.weight_scale)
        xq, x_scale = quantize_static_ref(x, self.input_scale)
        return scaled_mm(xq, x_scale, self.qweight, self.scale_row)

    def takes_fp8_rows(self, num_tokens: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether `forward` of [num_tokens, in] rows of `dtype` on `device` quantizes them per
        token (kernels/fp8_quant.py) for torch._scaled_mm. Where it does, the kernel making the
        rows may quantize them itself and hand them to `forward_fp8` (engine/models/
        fp8_inputs.py). Above W8A16_MAX_TOKENS, so above the GEMVs' 4 tokens too."""
        return (num_tokens > W8A16_MAX_TOKENS and device.type == "cuda" and self.use_scaled_mm
                and dtype == torch.bfloat16 and self.input_scale is None)

    def forward_fp8(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """`forward` of rows x given quantized per token, (xq [T, in] float8_e4m3fn, x_scale
        [T, 1] fp32) as kernels/fp8_quant.py makes them: [T, out], bit for bit forward(x)
        where `takes_fp8_rows` holds."""
        y = self._rows_mm(xq, x_scale)
        return y if self.bias is None else y + self.bias

    def _rows_mm(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """Rows quantized per token times the weight: [T, out] bf16."""
        if self.triton_gemm:
            from kernels.fp8_gemm import fp8_gemm

            return fp8_gemm(xq, x_scale, self.qweight, self.weight_scale)
        return scaled_mm(xq, x_scale, self.qweight, self.scale_row)

    def weight_bytes(self) -> int:
        return self.qweight.nbytes + self.weight_scale.nbytes
