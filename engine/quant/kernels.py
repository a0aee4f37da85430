"""CPU matmuls over GGUF weights in the unpacked layout of `blocks.py`, each beside its reference.

    NibbleKernel    Q4_0 / Q4_1 / Q4_K and Q8_0 with bf16 activations on a CPU with AVX512-BF16
                    or AVX2 (`cpu_nibble.preferred()`): the codes fed to bf16 dot products as
                    they are, or made fp32 weights in registers on AVX2 (kernels/cpu_nibble.py),
                    outputs in the activations' dtype (fp32 sums, not rounded to bf16 for fp32
                    activations). Steps of DENSE_MIN_TOKENS rows or more multiply a transient
                    de-quantized bf16 W^T where the CPU has a bf16 dot product. Elsewhere (no
                    AVX2, no C compiler) the two kernels below serve these formats.
    Int4PackKernel  Q4_0 / Q4_1 / Q4_K: torch's packed int4 CPU GEMM, bf16 activations. torch's
                    group convention is w = (nibble - 8) * s + z, so a block with w = s * code + b
                    and nibble = code + offset (offset 8 for Q4_0, else 0) has
                    z = b + s * (8 - offset). Scales and zeros are held in bf16. Steps of many
                    tokens multiply a transient de-quantized bf16 copy instead (int4_dense.py).
    SplitInt8Kernel Q8_0 with bf16 activations where kernels/cpu_nibble.py does not run: an
                    int8 code is 16 * hi + lo with hi in -8..7, lo in 0..15, so the matmul is
                    two int4 GEMMs (hi with scale 16 s, lo with s).
    DequantKernel   any format, any dtype: de-quantizes `tile_rows` rows at a time into the
                    activations' dtype and multiplies (exact in fp32; never the whole matrix).
    DenseKernel     F32/F16/BF16 GGUF tensors: a plain F.linear.

Every kernel maps x [T, K] to [T, N] in x's dtype. `reference_linear` is the slow, obviously
correct version: gguf's own de-quantization of the raw blocks, then a matmul.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.quant.blocks import FOUR_BIT, QuantWeight, dequantize
from engine.quant.ggml_types import GGMLQuantizationType
from engine.quant.int4_dense import (
    DENSE_MIN_TOKENS,
    dense_supported,
    dense_weight_t,
    has_bf16_dot,
    nibble_rows,
    whole_blocks,
)
from kernels import cpu_nibble

Q = GGMLQuantizationType
_GROUP = 32  # the int4 kernels' group size (one GGUF block)
_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu wants N % 16 == 0
_TILE_ELEMENTS = 1 << 18  # DequantKernel: ~1 MiB of fp32 weights per tile


def reference_linear(
    x: torch.Tensor, raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> torch.Tensor:  # [T, K] x raw blocks of a [N, K] matrix -> [T, N] fp32
    from gguf.quants import dequantize as gguf_dequantize

    w = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(shape).astype(np.float32))
    return x.float() @ w.t()


def int4pack_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default if int4pack_available() else None


class Int4PackKernel:
    """nibbles [N, K] in 0..15, scale and zero [N, K / 32]: y = x @ ((nib - 8) * s + z)^T.
    The GEMM rounds activations, scales, zeros and outputs to bf16 (accumulating in fp32)."""

    def __init__(self, nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        self.out_features = nibbles.shape[0]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.int(), 1)
        # [K / 32, N, 2]: torch's qScaleAndZeros layout
        self.scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        self.scales_and_zeros = self.scales_and_zeros.to(torch.bfloat16)
        self.densifies = dense_supported(self.packed)

    @classmethod
    def from_quant(cls, w: QuantWeight) -> Int4PackKernel:
        if w.qtype not in FOUR_BIT or w.group != _GROUP:
            raise ValueError(f"{w.qtype.name} does not fit an int4 group of {_GROUP}")
        offset = 8 if w.qtype == Q.Q4_0 else 0
        zero = w.scale * (8 - offset)
        if w.bias is not None:
            zero = w.bias + zero
        return cls(w.codes.int() + offset, w.scale, zero)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        return self.bf16(x.to(torch.bfloat16)).to(x.dtype)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] bf16 -> [T, N] bf16
        """The GEMM alone (no casts): the resolved overload, skipping the op packet's Python
        dispatch (a decode step makes 120 of these calls); from DENSE_MIN_TOKENS rows, a bf16
        matmul with the de-quantized weight (int4_dense.py)."""
        if self.densifies and x.shape[0] >= DENSE_MIN_TOKENS:
            return x @ self.dense_t()
        return _INT4_MM(x, self.packed, _GROUP, self.scales_and_zeros)

    def dense_t(self) -> torch.Tensor:  # [K, N] bf16, made for one call
        return dense_weight_t(self.packed, self.scales_and_zeros)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


class SplitInt8Kernel:
    """Q8_0 (codes -128..127, group 32, no bias) as two int4 GEMMs summed in fp32."""

    def __init__(self, w: QuantWeight) -> None:
        if w.qtype != Q.Q8_0:
            raise ValueError(f"SplitInt8Kernel takes Q8_0, got {w.qtype.name}")
        codes = w.codes.int()
        hi, lo = codes >> 4, codes & 15  # codes == 16 * hi + lo, hi in -8..7
        zeros = torch.zeros_like(w.scale)
        self.high = Int4PackKernel(hi + 8, w.scale * 16, zeros)
        self.low = Int4PackKernel(lo, w.scale, w.scale * 8)
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)  # both halves' input, cast once
        if self.high.densifies and x.shape[0] >= DENSE_MIN_TOKENS:  # one matmul, W summed
            weight_t = self.high.dense_t()
            weight_t += self.low.dense_t()  # in place: two transient matrices at a time, not three
            return (xb @ weight_t).to(x.dtype)
        return (self.high.bf16(xb).float() + self.low.bf16(xb)).to(x.dtype)  # summed in fp32

    def nbytes(self) -> int:
        return self.high.nbytes() + self.low.nbytes()

    def codes_readable(self) -> bool:  # whole blocks of a known packing only (int4_dense.py)
        return whole_blocks(self.high.packed)

    def codes(self, rows: torch.Tensor) -> torch.Tensor:  # [R] row ids -> [R, K] int8
        """The int8 codes of some rows, read back from the two packed nibble tensors (so an
        embedding table needs no other copy of them); `whole_blocks(high.packed)` first."""
        hi, lo = (nibble_rows(k.packed, rows).to(torch.int16) for k in (self.high, self.low))
        return (16 * (hi - 8) + lo).to(torch.int8)


class NibbleKernel:
    """A Q4 (w = s q + z, q = code + offset in 0..15) or Q8_0 (w = d c) matrix in
    kernels/cpu_nibble.py's packed layout: y = x W^T with x rounded to bf16, summed in fp32."""

    def __init__(self, w: QuantWeight) -> None:
        rows, cols = w.shape
        if not self._shape_fits(w):
            raise ValueError(f"NibbleKernel needs groups of {_GROUP}, rows % 16 == 0 and "
                             f"columns % {_GROUP} == 0, got {w.qtype.name} {tuple(w.shape)}")
        self.out_features, self.in_features = rows, cols
        if w.qtype == Q.Q8_0:
            self.fmt, self.codes_packed = cpu_nibble.Q8, cpu_nibble.pack_q8(w.codes)
            self.zero = None
        elif w.qtype in FOUR_BIT:
            offset = 8 if w.qtype == Q.Q4_0 else 0
            self.fmt = cpu_nibble.Q4
            self.codes_packed = cpu_nibble.pack_q4(w.codes.to(torch.int16) + offset)
            zero = -offset * w.scale if w.bias is None else w.bias - offset * w.scale
            self.zero = cpu_nibble.pack_groups(zero)
        else:
            raise ValueError(f"NibbleKernel takes Q4_0, Q4_1, Q4_K or Q8_0, got {w.qtype.name}")
        self.scale = cpu_nibble.pack_groups(w.scale)
        self.gemm = cpu_nibble.Gemm(self.fmt, self.codes_packed, self.scale, self.zero, rows)
        # long steps de-quantize for a bf16 GEMM only where the CPU has a bf16 dot product: on
        # AVX2 alone torch's bf16 matmul is 6x slower than this kernel at 32 rows
        self.densifies = has_bf16_dot()

    @staticmethod
    def _shape_fits(w: QuantWeight) -> bool:  # whole tiles of 16 rows, whole groups of 32
        rows, cols = w.shape
        return w.group == _GROUP and rows % 16 == 0 and cols % _GROUP == 0

    @staticmethod
    def fits(w: QuantWeight) -> bool:
        """Whether make_kernel should take this kernel for `w` here."""
        wanted = w.qtype == Q.Q8_0 or w.qtype in FOUR_BIT
        return wanted and cpu_nibble.preferred() and NibbleKernel._shape_fits(w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N] in x's dtype
        dtype = x.dtype
        if self.densifies and x.shape[0] >= DENSE_MIN_TOKENS:
            return (x.to(torch.bfloat16) @ self.dense_t()).to(dtype)
        if dtype == torch.float32 or dtype == torch.bfloat16:  # fp32 x: rounded in the kernel
            return self.gemm(x, dtype)
        return self.gemm(x, torch.float32).to(dtype)

    def dense_t(self) -> torch.Tensor:  # [K, N] bf16, made for one call
        return cpu_nibble.dequant_t(self.fmt, self.codes_packed, self.scale, self.zero,
                                    self.out_features, self.in_features)

    def codes_readable(self) -> bool:
        return self.fmt == cpu_nibble.Q8

    def codes(self, rows: torch.Tensor) -> torch.Tensor:  # [R] row ids -> [R, K] int8
        """A Q8_0 table's codes of some rows, read back from the packed bytes (an embedding
        table then needs no other copy of them)."""
        return cpu_nibble.unpack_rows(self.fmt, self.codes_packed, rows).to(torch.int8)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:  # [R] row ids -> [R, K / 32] fp32
        """Some rows' group scales read back from the packed fp16 ones (a GGUF file stores
        Q8_0's scales in fp16: then exact, and the table needs no fp32 copy of them)."""
        return cpu_nibble.unpack_groups(self.scale, rows)

    def nbytes(self) -> int:
        extra = 0 if self.zero is None else self.zero.nbytes
        return self.codes_packed.nbytes + self.scale.nbytes + extra


class DequantKernel:
    """Any format: per tile of rows, de-quantize into x's dtype and F.linear."""

    def __init__(self, w: QuantWeight) -> None:
        self.weight = w
        self.out_features = w.shape[0]
        self.tile_rows = max(1, _TILE_ELEMENTS // w.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if n <= self.tile_rows:
            return F.linear(x, dequantize(self.weight, x.dtype))
        out = x.new_empty(*x.shape[:-1], n)
        for start in range(0, n, self.tile_rows):
            rows = slice(start, min(start + self.tile_rows, n))
            out[..., rows] = F.linear(x, dequantize(self.weight.rows(rows), x.dtype))
        return out

    def nbytes(self) -> int:
        w = self.weight
        extra = 0 if w.bias is None else w.bias.nbytes
        return w.codes.nbytes + w.scale.nbytes + extra


class DenseKernel:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def nbytes(self) -> int:
        return self.weight.nbytes


Kernel = NibbleKernel | Int4PackKernel | SplitInt8Kernel | DequantKernel | DenseKernel


def make_kernel(w: QuantWeight | torch.Tensor, dtype: torch.dtype) -> Kernel:
    """The fastest kernel for `w` with activations in `dtype`: the bf16-dot kernel or torch's
    packed int4 GEMMs need bf16 (torch's fp32 variant is a slow reference loop), else the tiled
    de-quantizing matmul (exact in fp32)."""
    if isinstance(w, torch.Tensor):
        return DenseKernel(w.to(dtype))
    if dtype == torch.bfloat16 and NibbleKernel.fits(w):
        return NibbleKernel(w)
    rows_fit = w.shape[0] % _ROW_MULTIPLE == 0
    if dtype == torch.bfloat16 and int4pack_available() and w.group == _GROUP and rows_fit:
        if w.qtype in FOUR_BIT:
            return Int4PackKernel.from_quant(w)
        if w.qtype == Q.Q8_0:
            return SplitInt8Kernel(w)
    return DequantKernel(w)
