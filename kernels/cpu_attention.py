"""A CPU decode step's attention in one C call a layer (kernels/cpu_attention.c): rotary, the K/V
store and paged attention over the decodes' blocks, fp32 or bf16.

The torch path (engine/attention/torch_backend.py) spends ~27 small ops a layer on the same work
(the rotation, the two stores, the blocks' gather, the mask and SDPA); on a 2-core CPU each op
costs several microseconds, more than the arithmetic of a short decode. This kernel reads the
cache in place (no gather), walks each sequence's blocks with an online softmax, and computes
what the torch path computes within fp32 rounding (`reference` below is that path, op for op).

Built once per machine with the system's C compiler (kernels/cpu_build.py, `-march=native`) and
loaded after torch, whose OpenMP runtime it shares. No compiler or a failed build: `library()`
is None and the torch path serves. `PDSERVE_CPU_ATTENTION=0` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from kernels import cpu_build

SOURCE = Path(__file__).with_suffix(".c")
INCLUDES = (cpu_build.EXP_HEADER,)
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-march=native", "-mprefer-vector-width=512"]
CHOICE_ENV = "PDSERVE_CPU_ATTENTION"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK_SIZE = 256, 16, 128  # the C file's MAX_D, MAX_G, MAX_BS
ERRORS = {-1: "shape outside the kernel's limits", -2: "a slot outside the cache",
          -3: "a block id outside the cache"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot run here (logged once)."""
    if os.environ.get(CHOICE_ENV) == "0":
        return None
    lib = cpu_build.load(SOURCE, FLAGS, "torch's ops serve CPU attention", INCLUDES)
    if lib is None:
        return None
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t
    lib.cpu_paged_decode.argtypes = [i, i, i, i, i, p, n, p, n, p, n, p, p, n, p,
                                     ctypes.c_int64, i, p, p, n, p, ctypes.c_float, p, i]
    lib.cpu_paged_decode.restype = i
    return lib


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
         cos: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands: CPU tensors of one dtype (fp32 or bf16, the
    cache's too), heads D apart with unit stride, shapes within the C file's limits."""
    dtype = q.dtype
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[-2]
    return (
        dtype in DTYPES
        and not q.is_cuda
        and k.dtype == v.dtype == kv_cache.dtype == dtype
        and (cos is None or (cos.dtype == dtype and cos.stride(1) == 1))
        and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0
        and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
        and kv_cache.shape[2] <= MAX_BLOCK_SIZE and kv_cache.is_contiguous()
        and all(x.stride()[1:] == (head_dim, 1) for x in (q, k, v))
    )


class StepArgs:
    """A step's arguments every layer shares (the tables' pointers), taken once. The tensors
    are kept alive: the C side reads their memory."""

    def __init__(self, slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
        slots, seq_lens = slots.contiguous(), seq_lens.to(torch.int32).contiguous()
        tables = tables.to(torch.int32)
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        self.tensors = (slots, tables, seq_lens, cos, sin)
        self.rope = (0, 0, 0) if cos is None else (cos.data_ptr(), sin.data_ptr(), cos.stride(0))
        self.tables = (slots.data_ptr(), tables.data_ptr(), tables.stride(0),
                       seq_lens.data_ptr())


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 step: StepArgs, scale: float) -> torch.Tensor:
    """q [T, H, D], k, v [T, Hkv, D] (rows of any stride) of T decodes -> out [T, H, D]; writes
    the rotated k and v into `kv_cache` [2, num_blocks, block_size, Hkv, D] (mutates it).
    Raises ValueError on a slot or block id outside the cache."""
    t, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = kv_cache.shape[1:4]
    out = torch.empty(t, num_heads, head_dim, dtype=q.dtype)
    err = library().cpu_paged_decode(
        DTYPES[q.dtype], t, num_heads, num_kv_heads, head_dim, q.data_ptr(), q.stride(0),
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), *step.rope, kv_cache.data_ptr(),
        num_blocks, block_size, *step.tables, scale, out.data_ptr(), torch.get_num_threads())
    if err:
        raise ValueError(f"cpu_attention: {ERRORS.get(err, err)}")
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
              cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The same in plain torch, one decode at a time: HF's rotation, the stores, SDPA over the
    sequence's keys gathered from its blocks (mutates `kv_cache` as the kernel does)."""
    from engine.models.rotary import apply_rotary

    if cos is not None:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0, slots], flat[1, slots] = k, v
    outs = []
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        ids = tables[i, : -(-n // block_size)].long()
        ks = kv_cache[0, ids].reshape(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
        vs = kv_cache[1, ids].reshape(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], ks, vs, scale=scale, enable_gqa=True)  # [H, 1, D]
        outs.append(o[:, 0])
    return torch.stack(outs)
