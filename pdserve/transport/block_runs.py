"""Runs of consecutive KV blocks copied by the GPU's copy engine: one cudaMemcpy2DAsync a run.

NOTE: in a pool [L, 2, N, block_size, Hkv, D] (kernels/kv_block_copy.py draws it) the rows
(layer, kv) are evenly spaced, row r = 2 * l + kv starting at r * N * E elements (E = a
block's elements), so blocks [b, b + n) of layers [l0, l1) form a 2-D region:

    height 2 * (l1 - l0) rows, width n * E elements, pitch N * E, origin (2 * l0) * N * E + b * E

    src (pitch N_src * E)                    dst (pitch N_dst * E)
    row 2*l0   | .. |s ... s+n| ..... |      | ..... |d ... d+n| .. |
    row 2*l0+1 | .. |s ... s+n| ..... |  ->  | ..... |d ... d+n| .. |
    ...

A run of blocks consecutive on both sides (s..s+n-1 -> d..d+n-1) is then one
cudaMemcpy2DAsync, which the copy engine moves at a peer copy's speed across two GPUs (the SMs'
stores over NVLink reached 0.3 of it: docs/benchmarks.md, "Two GPUs"). A fresh pool hands out
consecutive blocks, so a request's KV is often one run or a few; a fragmented pool makes many
short runs, where one kernel over all blocks is cheaper than a call per run (`runs` lets the
caller choose).

cudaMemcpy2DAsync is called through ctypes on the CUDA runtime that torch has loaded (torch
exposes no 2-D copy); the copy is queued on the current stream of the source's GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import numpy as np
import torch

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the driver finds each pointer's device (UVA)


def runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """The maximal runs (src_start, dst_start, length) of blocks consecutive on both sides, in
    order: src_ids [4, 5, 6, 9], dst_ids [0, 1, 2, 3] -> [(4, 0, 3), (9, 3, 1)]."""
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src_ids and dst_ids must be 1-D of one length; got {src.shape}, "
                         f"{dst.shape}")
    if src.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends)]


def copy_block_runs(src: torch.Tensor, dst: torch.Tensor, layer_start: int, layer_end: int,
                    block_runs: list[tuple[int, int, int]]) -> None:
    """dst[l, kv, d + i] = src[l, kv, s + i] for every run (s, d, n), i < n, layers
    [layer_start, layer_end), both K and V: one cudaMemcpy2DAsync a run on the current stream
    of src's GPU (launch only). Pools: contiguous, one dtype and block shape, on CUDA (either may
    be another GPU's memory mapped here). RuntimeError naming the CUDA error if a call fails."""
    if not (src.is_cuda and dst.is_cuda):
        raise ValueError("copy_block_runs copies between CUDA pools")
    if src.dtype != dst.dtype or src.shape[3:] != dst.shape[3:] or src.shape[:2] != dst.shape[:2]:
        raise ValueError(f"pools differ beyond their block counts: {tuple(src.shape)} "
                         f"{src.dtype} against {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("pools must be contiguous")
    block_bytes = src[0, 0, 0].numel() * src.element_size()
    spitch, dpitch = src.shape[2] * block_bytes, dst.shape[2] * block_bytes
    height = 2 * (layer_end - layer_start)
    src_row0 = src.data_ptr() + 2 * layer_start * spitch
    dst_row0 = dst.data_ptr() + 2 * layer_start * dpitch
    memcpy2d = _cudart().cudaMemcpy2DAsync
    stream = torch.cuda.current_stream(src.device).cuda_stream
    with torch.cuda.device(src.device):
        for s, d, n in block_runs:
            err = memcpy2d(ctypes.c_void_p(dst_row0 + d * block_bytes), ctypes.c_size_t(dpitch),
                           ctypes.c_void_p(src_row0 + s * block_bytes), ctypes.c_size_t(spitch),
                           ctypes.c_size_t(n * block_bytes), ctypes.c_size_t(height),
                           ctypes.c_int(_MEMCPY_DEFAULT), ctypes.c_void_p(stream))
            if err:
                raise RuntimeError(f"cudaMemcpy2DAsync failed: CUDA error {err} "
                                   f"({_cudart().cudaGetErrorString(err).decode()})")


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (found in this process's mappings), else the system's."""
    torch.cuda.init()
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                path = line.split()[-1]
                break
    lib = ctypes.CDLL(path or ctypes.util.find_library("cudart") or "libcudart.so")
    lib.cudaMemcpy2DAsync.restype = ctypes.c_int
    lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                      ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                      ctypes.c_int, ctypes.c_void_p]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    return lib
