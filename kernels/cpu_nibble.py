"""CPU GEMMs over 4-bit and 8-bit GGUF codes on AVX512-BF16 dot products, or on AVX2's fp32 FMAs
where a CPU has no AVX512-BF16 (kernels/cpu_nibble.c, one path or the other by its flags).

torch's packed int4 CPU GEMM widens every weight to fp32 and multiplies on the fp32 vector units;
its cost grows with the rows of x by ~1.5 ms per row over a decode step of the bundled model, which
is what a speculative verification (k + 1 rows) and a batch of decodes pay. This kernel feeds the
codes to VDPBF16PS as they are: a nibble q ORed into the bf16 bits 0x4300 *is* the number
128 + q, so the unpacking is an AND, a shift and two ORs per 32-byte load, the dot products
accumulate in fp32, and the group's scale and offset (and the 128) are applied once per group of
32 inputs (the C file gives the algebra). A row's arithmetic does not depend on the other rows or
on the thread count.

Packed layout (N % 16 == 0, K % 32 == 0), per tile of 16 output columns, then group, then load:

    Q4 (Q4_0 / Q4_1 / Q4_K: w = s q + z, q in 0..15)
        codes [N/16, K/4, 32] uint8: byte 2i + j of load k4 holds column i's q[4 k4 + j] in its
        low nibble and q[4 k4 + 2 + j] in its high one (j = 0, 1)
        s, z  [N/16, K/32, 16] fp16
    Q8 (Q8_0: w = d c, c in -128..127, stored as u = c + 128)
        codes [N/16, K/2, 32] uint8: byte 2i + j of load k2 holds column i's u[2 k2 + j]
        s = d [N/16, K/32, 16] fp16 (no z)

The scales stay fp16 as the file holds them (Q4_K's d * sc products are rounded to fp16 here),
so the weights take the file's bytes per block plus nothing. `nibble_dequant_t` writes W^T in
bf16 for steps long enough that a dense bf16 GEMM wins.

On a CPU with AVX2 but no AVX512-BF16 the same layout feeds fp32 FMAs instead: each input's
codes for 8 columns widen and become weights (`s q + z`) once per block of rows, then each row
adds `x_k w` in order (the C file's second path). There it is 1.2-2.4x torch's int4 GEMM at 1-32
rows, and the bundled model's single stream 2.2-2.6x faster (a 2-core AVX2 EPYC,
docs/benchmarks.md "GGUF codes on AVX2 alone").

The shared object is compiled once per machine with the system's C compiler (`$CC`, else
`cc`) into pdserve's cache folder and loaded after torch, whose OpenMP runtime it then shares
(same soname). No compiler, no AVX2, or a failed build: `library()` is None and the callers
keep torch's int4 kernel.

Where it serves (`preferred()`): every CPU it runs on, for every GGUF format it packs. On the
2-core EPYC pdserve is developed on, weights streamed from memory, it is about even with torch's
int4 GEMM at 1 row (0.70-1.13x), 0.94-1.32x at 4 and 1.2-3.4x from 8 rows (`python -m
pdserve.bench.cpu_int4_gemm`, docs/benchmarks.md). On Xeons with AMX the two 4-bit GEMMs are even
up to 128 rows (16 cores: 0.65-1.33x; 2 cores: 0.84-1.06x up to 64) and torch's, on AMX tiles,
is 2-7x faster from 256 rows, where both kernels give way to the de-quantized bf16 matmul
(DENSE_MIN_TOKENS); a decode step then saves the bf16 casts torch's GEMM needs around it (the
bundled model on a 2-core AMX Xeon: 7% less time a token, docs/benchmarks.md). torch has no int8
group GEMM: the two int4 GEMMs that stand in for Q8_0 (engine/quant/kernels.py
`SplitInt8Kernel`) were 1.6-2.4x slower up to 128 rows on the EPYC and 1.7x slower at 1-32 rows
on a 2-core AMX Xeon, and hold 10 bits a weight where this kernel holds 8.5.
`PDSERVE_CPU_NIBBLE=0` keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from kernels import cpu_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
INCLUDES = (cpu_build.EXP_HEADER,)
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-mf16c", "-mfma"]
AVX512_FLAGS = [*BASE_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
AVX2_FLAGS = [*BASE_FLAGS, "-mavx2"]
GROUP = 32
Q4, Q8 = 0, 1  # the C file's FMT_Q4, FMT_Q8
PRE_RMSNORM, PRE_SILU_MUL = 0, 1  # the C file's input prologues (nibble_gemm_pre)
CHOICE_ENV = "PDSERVE_CPU_NIBBLE"  # "0": never; "avx2": that path; else wherever it runs


def _cpu_has(probe: str) -> bool:
    return bool(getattr(torch.cpu, probe, lambda: False)())


def build(source: Path = SOURCE, out_dir: Path | None = None) -> Path:
    """Compile `source` (once, kernels/cpu_build.py) with this CPU's `flags()` and return the
    shared object's path; raises OSError / CalledProcessError on failure."""
    return cpu_build.build(source, flags() or AVX2_FLAGS, out_dir, includes=INCLUDES)


def flags() -> list[str] | None:
    """The build's flags on this CPU: AVX512-BF16's path where it has it, else AVX2's (with FMA
    and F16C, which every AVX2 CPU has); None on neither. `PDSERVE_CPU_NIBBLE=avx2` takes the
    AVX2 path on any AVX2 CPU (to compare the two)."""
    if _cpu_has("_is_avx512_bf16_supported") and os.environ.get(CHOICE_ENV) != "avx2":
        return AVX512_FLAGS
    if _cpu_has("_is_avx2_supported"):
        return AVX2_FLAGS
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (logged once)."""
    if os.environ.get(CHOICE_ENV) == "0":
        return None
    if (chosen := flags()) is None:
        log.info("cpu_nibble: no AVX2 on this CPU; torch's int4 kernel serves GGUF weights")
        return None
    lib = cpu_build.load(SOURCE, chosen, "torch's int4 kernel serves GGUF weights", INCLUDES)
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.nibble_gemm.argtypes = [p, i, ctypes.c_ssize_t, i, i, i, i, p, p, p, p, i, i]
    lib.nibble_gemm.restype = i
    lib.nibble_dequant_t.argtypes = [i, i, i, p, p, p, p, i]
    lib.nibble_dequant_t.restype = None
    f, n = ctypes.c_float, ctypes.c_ssize_t
    lib.nibble_gemm_pre.argtypes = [i, p, n, p, n, p, p, f, i, i, i, i, p, p, p, p, i, i]
    lib.nibble_gemm_pre.restype = i
    return lib


def available() -> bool:
    """Whether the kernel runs here."""
    return library() is not None


def preferred() -> bool:
    """Whether GGUF weights should take it here: wherever it runs (the module's note)."""
    return available()


def pack_q4(nibbles: torch.Tensor) -> torch.Tensor:  # [N, K] in 0..15 -> [N/16, K/4, 32] uint8
    n, k = nibbles.shape
    q = nibbles.to(torch.uint8).view(n // 16, 16, k // 4, 2, 2)  # tile, i, k4, half, j
    packed = q[..., 0, :] | (q[..., 1, :] << 4)  # low nibble: k4*4 + j, high: k4*4 + 2 + j
    return packed.permute(0, 2, 1, 3).reshape(n // 16, k // 4, 32).contiguous()


def pack_q8(codes: torch.Tensor) -> torch.Tensor:  # [N, K] int8 -> [N/16, K/2, 32] uint8
    n, k = codes.shape
    u = (codes.to(torch.int16) + 128).to(torch.uint8).view(n // 16, 16, k // 2, 2)
    return u.permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32).contiguous()


def pack_groups(values: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> [N/16, K/32, 16] fp16
    n, g = values.shape
    return values.to(torch.float16).view(n // 16, 16, g).transpose(1, 2).contiguous()


def unpack_rows(fmt: int, codes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The codes of some output rows (q for Q4, c for Q8) read back from the packed layout:
    [R] row ids -> [R, K] int16. The rows' tiles are gathered first (one index_select), then
    each row's lane: indexing the whole table on two dims at once took ~0.5 ms a lookup."""
    n = len(rows)
    tiles = codes.index_select(0, rows // 16).view(n, codes.shape[1], 16, 2)  # [R, loads, 16, 2]
    b = tiles[torch.arange(n), :, rows % 16]  # [R, loads, 2]: row r's bytes, load by load
    if fmt == Q4:
        q = torch.stack([b & 15, b >> 4], dim=-2)  # [R, K/4, half, j]: k = 4 k4 + 2 half + j
        return q.reshape(n, -1).to(torch.int16)
    return b.reshape(n, -1).to(torch.int16) - 128


def unpack_groups(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # -> [R, K/32] fp32
    return values[rows // 16, :, rows % 16].float()


class Gemm:
    """y = x W^T for one packed matrix: `fmt`, codes, s, z as packed above, N outputs. The
    pointers are taken once; a call costs one tensor allocation and the C call."""

    def __init__(self, fmt: int, codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
                 n: int) -> None:
        self.tensors = (codes, s, z)  # kept alive: the C side holds their pointers
        self.n, self.k = n, codes.shape[1] * (4 if fmt == Q4 else 2)  # K/4 or K/2 loads a tile
        self.pointers = (fmt, codes.data_ptr(), s.data_ptr(), 0 if z is None else z.data_ptr())
        self._call = library().nibble_gemm

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x [M, K] bf16 or fp32 (rounded to bf16 inside, as .to(torch.bfloat16) would) ->
        [M, N] in out_dtype (float32 or bfloat16)."""
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.to(torch.bfloat16)
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=out_dtype)
        if self._call(x.data_ptr(), x.dtype == torch.float32, x.stride(0), m, self.k, self.n,
                      *self.pointers, y.data_ptr(), out_dtype == torch.bfloat16,
                      torch.get_num_threads()):
            raise MemoryError(f"cpu_nibble: no scratch for {m} rows of {self.k}")
        return y

    def rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, r): r = x + residual (x when None), y = rms_norm(r, weight, eps) W^T, fp32
        rows in and out (the norm in fp32, then rounded to bf16 as __call__ rounds x)."""
        m = x.shape[0]
        r = torch.empty(m, self.k)
        y = torch.empty(m, self.n)
        res = (0, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        self._pre(PRE_RMSNORM, x, *res, r.data_ptr(), weight.data_ptr(), eps, y)
        return y, r

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) W^T for gate_up [M, 2K] fp32 (gate, then up) -> [M, N] fp32."""
        y = torch.empty(gate_up.shape[0], self.n)
        self._pre(PRE_SILU_MUL, gate_up, 0, 0, 0, 0, 0.0, y)
        return y

    def _pre(self, pre: int, x: torch.Tensor, res: int, ldr: int, r: int, w: int, eps: float,
             y: torch.Tensor) -> None:
        m = x.shape[0]
        if library().nibble_gemm_pre(pre, x.data_ptr(), x.stride(0), res, ldr, r, w, eps, m,
                                     self.k, self.n, *self.pointers, y.data_ptr(), 0,
                                     torch.get_num_threads()):
            raise MemoryError(f"cpu_nibble: no scratch for {m} rows of {self.k}")

    @staticmethod
    def takes_rows(*rows: torch.Tensor | None) -> bool:
        """Whether `rmsnorm` / `silu_mul` take these operands: 2-D fp32 CPU rows with unit
        stride (the norm's weight too)."""
        return all(t is None or (t.dtype == torch.float32 and t.dim() in (1, 2)
                                 and t.stride(-1) == 1 and not t.is_cuda) for t in rows)


def gemm(x: torch.Tensor, fmt: int, codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
         n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 or fp32 -> [M, n] in out_dtype (float32 or bfloat16)."""
    return Gemm(fmt, codes, s, z, n)(x, out_dtype)


def dequant_t(fmt: int, codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, n: int,
              k: int) -> torch.Tensor:
    """W^T [K, N] in bf16, made for one call."""
    out = torch.empty(k, n, dtype=torch.bfloat16)
    library().nibble_dequant_t(k, n, fmt, codes.data_ptr(), s.data_ptr(),
                               0 if z is None else z.data_ptr(), out.data_ptr(),
                               torch.get_num_threads())
    return out


def reference(x: torch.Tensor, fmt: int, codes: torch.Tensor, s: torch.Tensor,
              z: torch.Tensor | None, n: int) -> torch.Tensor:
    """The same product in fp32 from the packed tensors: x rounded to bf16 as the kernel reads
    it, the weights de-quantized from the unpacked codes and fp16 scales."""
    rows = torch.arange(n)
    q = unpack_rows(fmt, codes, rows).float()  # [N, K]
    scale = unpack_groups(s, rows).repeat_interleave(GROUP, dim=1)
    w = q * scale
    if fmt == Q4:
        w = w + unpack_groups(z, rows).repeat_interleave(GROUP, dim=1)
    return x.to(torch.bfloat16).float() @ w.t()
