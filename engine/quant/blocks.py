"""GGUF block formats unpacked once, at load time, into one layout every kernel reads:

    w[n, k] = scale[n, k // group] * codes[n, k]  (+ bias[n, k // group])

    format  group  codes (int8)              scale (fp32)        bias (fp32)
    Q4_0    32     nibble - 8                d                   -
    Q4_1    32     nibble (0..15)            d                   m
    Q8_0    32     q                         d                   -
    Q4_K    32     nibble (0..15)            d * sc[j] (6 bit)   -(dmin * m[j])
    Q6_K    16     6-bit value - 32          d * sc[j] (int8)    -

The products are formed exactly as `gguf.quants.dequantize` forms them, so `dequantize` here
equals gguf's de-quantization bit for bit in fp32. A block's 32 (or 16) weights are one group;
a K-quant super-block of 256 is 8 groups of 32 (Q4_K) or 16 of 16 (Q6_K).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.quant.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
SUPPORTED = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)
FOUR_BIT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)  # codes fit an int4 group of 32 (offset 8 for Q4_0)
DENSE = (Q.F32, Q.F16, Q.BF16)


@dataclass
class QuantWeight:
    """A [rows, cols] matrix in the unpacked layout above; `qtype` names the GGUF format."""

    qtype: GGMLQuantizationType
    codes: torch.Tensor  # [rows, cols] int8
    scale: torch.Tensor  # [rows, cols // group] fp32
    bias: torch.Tensor | None  # [rows, cols // group] fp32, or None
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The same format over a subset (or permutation) of the rows."""
        bias = None if self.bias is None else self.bias[index]
        return QuantWeight(self.qtype, self.codes[index], self.scale[index], bias, self.group)


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, cols] in `dtype` (computed in fp32): gguf's values exactly."""
    rows, cols = w.shape
    groups = w.codes.view(rows, cols // w.group, w.group).float()
    out = groups * w.scale.unsqueeze(-1)
    if w.bias is not None:
        out = out + w.bias.unsqueeze(-1)
    return out.view(rows, cols).to(dtype)


def unpack(
    qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, ...], name: str
) -> QuantWeight:
    """Unpack `raw` uint8 [rows, bytes per row] of a [rows, cols] GGUF matrix. Raises
    ValueError naming `name` and the type when the format is not one of SUPPORTED."""
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(
            f"tensor {name!r} has GGUF type {qtype.name}, which pdserve does not "
            f"run quantized (supported: {names}, F32, F16, BF16)"
        )
    if len(shape) != 2:
        raise ValueError(f"tensor {name!r}: a {qtype.name} tensor must be 2-D, got {shape}")
    rows, cols = shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(rows * (cols // block), type_size)
    codes, scale, bias, group = _UNPACKERS[qtype](blocks)
    return QuantWeight(
        qtype,
        torch.from_numpy(codes.reshape(rows, cols)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, cols // group))),
        None if bias is None else torch.from_numpy(bias.reshape(rows, cols // group)),
        group,
    )


def _f16(b: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n, 1] fp32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[n, width/2 * m] packed bytes -> [n, width * m]: per `width` values, the low nibbles
    of `width/2` bytes first, then their high nibbles (ggml's order)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, width // 2) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(n, -1)


def _q4_0(b: np.ndarray):
    return _nibbles(b[:, 2:], 32).astype(np.int8) - np.int8(8), _f16(b[:, :2]), None, 32


def _q4_1(b: np.ndarray):
    return _nibbles(b[:, 4:], 32).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q8_0(b: np.ndarray):
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None, 32


def _q4_k(b: np.ndarray):
    from gguf.quants import Q4_K

    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    scale = d * sc.astype(np.float32)  # [n, 8], as gguf forms it
    bias = -(dmin * m.astype(np.float32))
    return _nibbles(b[:, 16:], 64).astype(np.int8), scale, bias, 32


def _q6_k(b: np.ndarray):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(b[:, 208:210]) * scales  # [n, 16]
    low = _nibbles(ql, 128).reshape(n, -1, 32)  # per 128: ql[0:32] lo, [32:64] lo, hi, hi
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(n, -1, 32)
    codes = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return codes.reshape(n, -1), scale, None, 16


_UNPACKERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
