"""A Llama decoder layer for a CPU step of decodes in one C call (kernels/cpu_decode_layer.c,
which includes kernels/cpu_nibble.c and kernels/cpu_attention.c): the ctypes side. The layer's
constants (its packed projections, norms, heads) are one `Layer` struct made once; a step's
tables one `Step` struct made by the first layer; a call passes two pointers and the rows.

Built once per machine like kernels/cpu_nibble.c (with its AVX512-BF16 or its AVX2 path);
`library()` is None where it cannot run, and engine/models/cpu_decode_layer.py then leaves the
layer to its modules.
`PDSERVE_CPU_DECODE_LAYER=0` keeps the modules' path.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from kernels import cpu_attention, cpu_build, cpu_nibble

SOURCE = Path(__file__).with_suffix(".c")
CHOICE_ENV = "PDSERVE_CPU_DECODE_LAYER"
ERRORS = {**cpu_attention.ERRORS, -10: "projections that do not chain",
          -11: "no scratch memory"}


class Mat(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("z", ctypes.c_void_p)]


class LayerStruct(ctypes.Structure):
    _fields_ = [("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scale", ctypes.c_float),
                ("heads", ctypes.c_int32), ("kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32)]


class StepStruct(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("table_ld", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("rope_ld", ctypes.c_int64)]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot run here (logged once)."""
    if os.environ.get(CHOICE_ENV) == "0" or cpu_nibble.library() is None:
        return None
    nibble = cpu_nibble.flags()
    flags = [*nibble, "-march=native", "-mprefer-vector-width=512"]
    if nibble is cpu_nibble.AVX2_FLAGS:  # the AVX2 path even where -march=native has more
        flags.append("-mno-avx512bf16")
    lib = cpu_build.load(SOURCE, flags, "the layer's modules serve", (
        cpu_nibble.SOURCE, cpu_attention.SOURCE, cpu_build.EXP_HEADER))
    if lib is None:
        return None
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.cpu_decode_layer.argtypes = [p, p, p, i64, i, p, i64, p, i64, i, p, p, i]
    lib.cpu_decode_layer.restype = i
    return lib


def mat(gemm: cpu_nibble.Gemm) -> Mat:
    fmt, codes, s, z = gemm.pointers
    return Mat(fmt, gemm.n, gemm.k, codes, s, z)


class LayerArgs:
    """One layer's struct; `tensors` keeps what the C side points at alive."""

    def __init__(self, qkv: cpu_nibble.Gemm, o: cpu_nibble.Gemm, gate_up: cpu_nibble.Gemm,
                 down: cpu_nibble.Gemm, norm1: torch.Tensor, eps1: float, norm2: torch.Tensor,
                 eps2: float, heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
        self.tensors = (qkv, o, gate_up, down, norm1, norm2)
        self.struct = LayerStruct(mat(qkv), mat(o), mat(gate_up), mat(down), norm1.data_ptr(),
                                  norm2.data_ptr(), eps1, eps2, scale, heads, kv_heads, head_dim)
        self.ref = ctypes.addressof(self.struct)
        self.hidden = qkv.k


class StepArgs:
    """A step's struct (cpu_attention.StepArgs' tables, fp32 cos/sin)."""

    def __init__(self, tables: cpu_attention.StepArgs) -> None:
        self.tables = tables
        slots, table, table_ld, seq_lens = tables.tables
        cos, sin, rope_ld = tables.rope
        self.struct = StepStruct(slots, table, table_ld, seq_lens, cos, sin, rope_ld)
        self.ref = ctypes.addressof(self.struct)


def run(layer: LayerArgs, step: StepArgs, kv_cache: torch.Tensor, h: torch.Tensor,
        residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h + residual after the attention) of the layer for fp32 rows h [M, hidden] (the
    residual stream `residual` [M, hidden], None at layer 0); writes the step's K/V into
    `kv_cache` (fp32, [2, num_blocks, block_size, Hkv, D]). ValueError on a bad slot or block."""
    m = h.shape[0]
    both = torch.empty(2, m, layer.hidden)
    res = (0, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
    err = library().cpu_decode_layer(
        layer.ref, step.ref, kv_cache.data_ptr(), kv_cache.shape[1], kv_cache.shape[2],
        h.data_ptr(), h.stride(0), *res, m, both.data_ptr(), both[1].data_ptr(),
        torch.get_num_threads())
    if err:
        raise ValueError(f"cpu_decode_layer: {ERRORS.get(err, err)}")
    return both[0], both[1]
