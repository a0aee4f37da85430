"""GGUF weights kept quantized on CUDA: `QuantWeight`s (engine/quant/blocks.py) laid out for the
Triton GEMMs, and the de-quantized rows an embedding lookup reads.

    Q4_0 / Q4_1 / Q4_K   `Q4CudaKernel`: codes packed 8 to an int32 along K, per-32 scale and
                         float bias (kernels/gguf_q4.py; Q4_0's nibble - 8 becomes bias -8 d)
    Q8_0 / Q6_K          `Q8CudaKernel`: int8 codes [K, N], per-32 (Q8_0) or per-16 (Q6_K)
                         scales (kernels/gguf_q8.py)
    F32 / F16 / BF16     `DenseKernel` (engine/quant/kernels.py) on the device

Every step, whatever its token count, runs the Triton GEMM (split-K at few tokens); no layer is
ever de-quantized whole. Scales and biases are held in fp16 when that is exact (Q4_0, Q4_1,
Q8_0: they are fp16 in the file), else fp32 (the K-quants' d * sc products), so the layer
holds ~5 (Q4_0, Q4_1), 6 (Q4_K), 8.5 (Q8_0) or 10 (Q6_K) bits a weight. The kernels take any
device's tensors: on the CPU they run under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch

from engine.lazy_kernels import kernel
from engine.quant.blocks import FOUR_BIT, QuantWeight
from engine.quant.ggml_types import GGMLQuantizationType
from engine.quant.kernels import DenseKernel

gguf_q4_linear = kernel("gguf_q4", "gguf_q4_linear")
gguf_q8_linear = kernel("gguf_q8", "gguf_q8_linear")

Q = GGMLQuantizationType
EIGHT_BIT = (Q.Q8_0, Q.Q6_K)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:  # [N, K] int8 0..15 -> [K / 8, N] int32
    """kernels/w4a16.py's `pack_rows` of codes^T, in int32 (row 8 i + j in bits 4j..4j+3)."""
    n, k = codes.shape
    nibbles = codes.t().reshape(k // 8, 8, n).to(torch.int32)
    packed = torch.zeros(k // 8, n, dtype=torch.int32, device=codes.device)
    for j in range(8):
        packed |= nibbles[:, j] << (4 * j)
    return packed


def _compact(t: torch.Tensor) -> torch.Tensor:  # [N, K / G] fp32 -> [K / G, N], fp16 if exact
    t = t.t().contiguous()
    half = t.half()
    return half if torch.equal(half.float(), t) else t


class Q4CudaKernel:
    """y = x @ W^T for a 4-bit `QuantWeight` W [N, K] (Q4_0, Q4_1, Q4_K)."""

    def __init__(self, w: QuantWeight, device: torch.device) -> None:
        if w.qtype not in FOUR_BIT or w.group != 32:
            raise ValueError(f"Q4CudaKernel takes Q4_0 / Q4_1 / Q4_K, got {w.qtype.name}")
        self.out_features, self.in_features = w.shape
        offset = 8 if w.qtype == Q.Q4_0 else 0  # Q4_0's codes are nibble - 8
        bias = -offset * w.scale if w.bias is None else w.bias
        scales, biases = _compact(w.scale), _compact(bias)
        if scales.dtype != biases.dtype:
            scales, biases = scales.float(), biases.float()
        self.qweight = pack_codes(w.codes + offset).to(device)  # [K / 8, N]
        self.scales, self.biases = scales.to(device), biases.to(device)  # [K / 32, N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        flat = x.reshape(-1, self.in_features).contiguous()
        y = gguf_q4_linear(flat, self.qweight, self.scales, self.biases, 32)
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T] -> [T, K]
        """Rows `ids` of W de-quantized (an embedding lookup), computed in fp32."""
        packed = self.qweight[:, ids]  # [K / 8, T]
        shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
        codes = ((packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(-1, ids.numel())
        scale = self.scales[:, ids].float().repeat_interleave(32, 0)  # [K, T]
        bias = self.biases[:, ids].float().repeat_interleave(32, 0)
        return (codes.float() * scale + bias).t().contiguous().to(dtype)

    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + self.biases.nbytes


class Q8CudaKernel:
    """y = x @ W^T for an int8-coded `QuantWeight` W [N, K] (Q8_0, Q6_K)."""

    def __init__(self, w: QuantWeight, device: torch.device) -> None:
        if w.qtype not in EIGHT_BIT:
            raise ValueError(f"Q8CudaKernel takes Q8_0 / Q6_K, got {w.qtype.name}")
        self.out_features, self.in_features = w.shape
        self.group = w.group
        self.codes = w.codes.t().contiguous().to(device)  # [K, N] int8
        self.scales = _compact(w.scale).to(device)  # [K / G, N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        flat = x.reshape(-1, self.in_features).contiguous()
        y = gguf_q8_linear(flat, self.codes, self.scales, self.group)
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T] -> [T, K]
        codes = self.codes[:, ids].float()  # [K, T]
        scale = self.scales[:, ids].float().repeat_interleave(self.group, 0)
        return (codes * scale).t().contiguous().to(dtype)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


CudaKernel = Q4CudaKernel | Q8CudaKernel | DenseKernel


def make_cuda_kernel(w: QuantWeight | torch.Tensor, dtype: torch.dtype,
                     device: torch.device) -> CudaKernel:
    """The kernel for `w` on `device` (dense tensors in `dtype`). ValueError for a block format
    neither kernel takes (blocks.py unpacks only those)."""
    if isinstance(w, torch.Tensor):
        return DenseKernel(w.to(device, dtype))
    if w.qtype in FOUR_BIT:
        return Q4CudaKernel(w, device)
    if w.qtype in EIGHT_BIT:
        return Q8CudaKernel(w, device)
    raise ValueError(f"GGUF type {w.qtype.name} has no CUDA kernel")
