"""`W4A16Linear`: y = x W^T (+ b) with W [out, in] in 4 bits (AWQ, GPTQ, compressed-tensors
pack-quantized checkpoints; engine/quant/w4a16.py), one rank.

Once every row has arrived the layer holds kernels/w4a16.py's layout: `qweight` [K / 8, N]
int32, `scales` [K / G, N] fp32, `zeros` [K / G, N] uint8, and `perm` [K] when act-order
groups were not consecutive (x's columns are gathered by it first). Where it computes:

    CUDA, steps of 1 token                the W4A16 GEMV (kernels/w4a16_gemv.py, split-K),
                                          codes in fp16 pairs (`pairs`); with `prologues`,
                                          the norm before q/k/v and gate_up and the SwiGLU
                                          before down in its prologue (`rmsnorm_linear`,
                                          `silu_mul_linear`: the model's fused-call hooks)
    CUDA, up to GEMM_MAX_TOKENS           the W4A16 Triton GEMM (kernels/w4a16.py); a group
                                          size it cannot take (G % 16) de-quantizes
    CUDA, more tokens (large batches,     W de-quantized to x's dtype by a Triton kernel, then
    prefills)                             cuBLAS (kernels/w4a16_dequant.py)
    CPU, bf16, G in 32..256, N % 16 == 0  torch's packed int4 GEMM (`_weight_int4pack_mm_for_
                                          cpu`: w = (nibble - 8) * s + z', so z' = (8 - z) * s)
    CPU otherwise                         de-quantize W [N, K] into x's dtype, F.linear: in fp32
                                          exactly the de-quantized model
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.lazy_kernels import kernel
from engine.quant.w4a16 import W4A16Weight, concat_rows, group_order

block_k_for, dequantize_ref = kernel("w4a16", "block_k_for"), kernel("w4a16", "dequantize_ref")
pack_rows, w4a16_linear = kernel("w4a16", "pack_rows"), kernel("w4a16", "w4a16_linear")
gemv_rows, w4a16_gemv = kernel("w4a16_gemv", "gemv_rows"), kernel("w4a16_gemv", "w4a16_gemv")
w4a16_gemv_rmsnorm = kernel("w4a16_gemv", "w4a16_gemv_rmsnorm")
w4a16_gemv_swiglu = kernel("w4a16_gemv", "w4a16_gemv_swiglu")
w4a16_dequant_linear = kernel("w4a16_dequant", "w4a16_dequant_linear")

# Steps of more tokens de-quantize W and call cuBLAS: on an H200 that beat the in-register
# GEMM at every shape from 128 tokens (1.5-3.5x) and reached 0.97-1.0x bf16 from 4k tokens
# (docs/benchmarks.md, "W4A16 at batch and prefill sizes"); at 64 the two were even.
GEMM_MAX_TOKENS = 64

_INT4PACK_GROUPS = (32, 64, 128, 256)


class W4A16Linear(nn.Module):
    """Like `Fp8Linear`: an empty `weight` parameter (its dtype: the model's, set by `.to`) whose
    `weight_loader` takes a `W4A16Weight` for rows `rows` of the whole matrix; fused q/k/v and
    gate/up arrive as row ranges and are packed together once all are in."""

    # The norm and SwiGLU in the GEMV's prologue (`rmsnorm_linear`, `silu_mul_linear`) instead
    # of kernels of their own. Off: on an H200 the fused step was no faster (0.933 / 0.934 ms
    # against 0.938 / 0.929; the GEMVs took the 71 us the 48 launches saved), nor with the
    # prologue's L2 prefetch (0.941-0.995 against 0.976-1.058 at the same position;
    # pdserve/bench/gpu_quant.py system w4a16_fused turns it on).
    prologues = False
    # The GEMV's codes multiplied two at a time in fp16 (kernels/nibble_pairs.py) where x is
    # bf16 or fp16; off: its fp32 loop (pdserve/bench/gpu_quant.py system w4a16_fp32).
    pairs = True
    # Steps of the GEMV's loads in flight (Triton's software pipeline; 1: none).
    stages = 1
    # The GEMV's codes by TMA descriptor, `stages` tiles in flight (Hopper; gpu_quant system
    # w4a16_tma). Off: not yet timed on a GPU.
    tma = False

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.weight.weight_loader = self._load
        self.weight.loads_shards = True  # takes fused q/k/v and gate/up rows itself
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._parts: dict[int, W4A16Weight] = {}  # first row -> rows still to pack
        self.group_size = 0
        self.qweight: torch.Tensor | None = None  # [K / 8, N] int32 (None: the CPU int4 copy)
        self.scales: torch.Tensor | None = None  # [K / G, N] fp32
        self.zeros: torch.Tensor | None = None  # [K / G, N] uint8
        self.perm: torch.Tensor | None = None  # [K] int64: x's columns in W's row order
        self.int4pack: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU bf16 kernel

    def _load(self, param: nn.Parameter, rows: slice, tensor: object, name: str) -> None:
        if not isinstance(tensor, W4A16Weight):
            raise ValueError(f"weight {name!r} is not 4-bit quantized ({type(tensor).__name__}); "
                             "pdserve serves W4A16 checkpoints with every attention and MLP "
                             "projection quantized")
        start, stop, _ = rows.indices(self.out_features)
        if tuple(tensor.shape) != (stop - start, self.in_features):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{(stop - start, self.in_features)}")
        self._parts[start] = tensor
        if sum(p.shape[0] for p in self._parts.values()) == self.out_features:
            self._pack([self._parts[s] for s in sorted(self._parts)], name)
            self._parts = {}

    def _pack(self, parts: list[W4A16Weight], name: str) -> None:
        """Side effects: the layer's packed tensors on its device; the unpacked codes dropped."""
        device = self.weight.device
        whole = concat_rows(parts, name)
        self.perm = group_order(whole, name)
        codes = whole.codes if self.perm is None else whole.codes[self.perm]
        self.group_size = whole.group_size
        self.scales = whole.scales.float().contiguous().to(device)
        self.zeros = whole.zeros.to(torch.uint8).contiguous().to(device)
        self.perm = None if self.perm is None else self.perm.to(device)
        if self._int4pack_fits(device):
            nibbles = codes.t().contiguous().int()  # [N, K]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
            zero = (8 - self.zeros.float()) * self.scales  # torch's w = (q - 8) * s + zero
            pairs = torch.stack([self.scales, zero], -1).to(torch.bfloat16)  # [K / G, N, 2]
            self.int4pack = (packed, pairs)
        else:
            self.qweight = pack_rows(codes.to(device))

    def _int4pack_fits(self, device: torch.device) -> bool:
        return (device.type == "cpu" and self.weight.dtype == torch.bfloat16
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
                and self.group_size in _INT4PACK_GROUPS and self.out_features % 16 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4pack is not None:
            packed, pairs = self.int4pack
            xb = self._gather(x).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, self.group_size, pairs)
            return y.to(x.dtype)
        if x.device.type == "cuda":
            from kernels.w4a16_gemv import GEMV_MAX_TOKENS

            args = (self._gather(x).contiguous(), self.qweight, self.scales, self.zeros,
                    self.group_size)
            if x.shape[0] <= GEMV_MAX_TOKENS and gemv_rows(self.group_size, x.shape[1]):
                return w4a16_gemv(*args, pairs=self._pairs(), stages=self.stages,
                                  tma=self.tma)
            if x.shape[0] > GEMM_MAX_TOKENS and block_k_for(self.group_size, 8):
                return w4a16_dequant_linear(*args)
            if block_k_for(self.group_size) is not None:
                return w4a16_linear(*args)
        return F.linear(x, self.dequantized(x.dtype))

    def rmsnorm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self(norm(x + residual)), x + residual) as one W4A16 GEMV launch where the layer
        takes its GEMV (engine/models/tp_layers.py `rmsnorm_linear` calls it); None elsewhere."""
        if not self._gemv_fits(x, x.shape[-1]) or (residual is not None
                                                   and not residual.is_contiguous()):
            return None
        y, s = w4a16_gemv_rmsnorm(x, residual, norm.weight, norm.eps, self.qweight,
                                  self.scales, self.zeros, self.group_size,
                                  pairs=self._pairs(), stages=self.stages, tma=self.tma)
        return (y if self.bias is None else y + self.bias), s

    def silu_mul_linear(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(silu(gate) * up) of gate_up = [gate | up] as one W4A16 GEMV launch where the
        layer takes its GEMV (tp_layers `silu_mul_linear` calls it); None elsewhere."""
        if not self._gemv_fits(gate_up, gate_up.shape[-1] // 2):
            return None
        y = w4a16_gemv_swiglu(gate_up, self.qweight, self.scales, self.zeros, self.group_size,
                              pairs=self._pairs(), stages=self.stages, tma=self.tma)
        return y if self.bias is None else y + self.bias

    def _pairs(self) -> bool | None:
        """The GEMV's `pairs`: None (wherever they fit) or False."""
        return None if self.pairs else False

    def _gemv_fits(self, x: torch.Tensor, k: int) -> bool:
        """Whether a step of x takes the GEMV with its prologue: CUDA, a token, no act-order
        gather (the norm's columns would need it too), x's rows contiguous."""
        from kernels.w4a16_gemv import GEMV_MAX_TOKENS

        return (self.prologues and self.qweight is not None and x.device.type == "cuda"
                and x.dim() == 2
                and 0 < x.shape[0] <= GEMV_MAX_TOKENS and k == self.in_features
                and self.perm is None and x.stride(-1) == 1
                and gemv_rows(self.group_size, k) is not None)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else x.index_select(-1, self.perm)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`, in the checkpoint's column order (what the reference path and
        the de-quantized model multiply)."""
        if self.qweight is None:
            raise ValueError("the CPU int4 layer keeps no unpacked codes to de-quantize")
        w = dequantize_ref(self.qweight, self.scales, self.zeros, self.group_size)  # [K, N]
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm, w)
        return w.t().contiguous().to(dtype)

    def weight_bytes(self) -> int:
        held = [self.scales, self.zeros, self.perm, self.qweight,
                *(self.int4pack if self.int4pack is not None else ())]
        return sum(t.nbytes for t in held if t is not None)
