"""KV block copy: whole blocks of one paged KV pool into another (a prefill worker writing its
blocks straight into a decode worker's pool, mapped over CUDA IPC).

NOTE: a pool is one contiguous tensor [L, 2, N, block_size, Hkv, D], so each block's
E = block_size * Hkv * D elements are one contiguous run, and the block (l, kv, b) starts at

    l * stride_l + kv * stride_kv + b * E          stride_kv = N * E,  stride_l = 2 * N * E

    pool: | layer 0                                         | layer 1            | ...
          | K: b0 | b1 | .. | bN-1 | V: b0 | b1 | .. | bN-1 | K: b0 | b1 | ..    |
              '-E-'

with N (and so the strides) that pool's own: src and dst may hold different numbers of blocks.
grid (n, 2, layer_end - layer_start): program (i, kv, j) copies block src_ids[i] of
(layer_start + j, kv) in src to block dst_ids[i] of the same (layer, kv) in dst, BLOCK elements
at a time. Offsets are int64: 32 layers of 16 tokens x 8 heads x 128 dims pass 2**31 elements
at 2048 blocks.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET
from kernels.kv_cache_fp8 import KV_FP8, as_bytes, index_copy_kv

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, KV_FP8)  # fp8: copied as bytes
ID_DTYPES = (torch.int64, torch.int32)


# layer_start changes from call to call (layer-wise transfer): not specialised on, so a new value
# never costs a compile mid-serving.
@triton.jit(do_not_specialize=["layer_start"])
def _copy_blocks_kernel(
    src_ptr,  # [L, 2, N_src, block_size, Hkv, D], contiguous
    dst_ptr,  # [L, 2, N_dst, block_size, Hkv, D], contiguous, src's dtype
    src_ids_ptr,  # [n] int32/int64, blocks of src, stride stride_src_id
    dst_ids_ptr,  # [n] int32/int64, blocks of dst, stride stride_dst_id
    layer_start,
    stride_src_id, stride_dst_id,
    stride_src_l, stride_src_kv,  # 2 * N_src * E, N_src * E
    stride_dst_l, stride_dst_kv,  # 2 * N_dst * E, N_dst * E
    BLOCK_NUMEL: tl.constexpr,  # E = block_size * Hkv * D
    BLOCK: tl.constexpr,  # elements moved per step, a power of 2
):
    i = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64) + layer_start
    src_block = tl.load(src_ids_ptr + i * stride_src_id).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i * stride_dst_id).to(tl.int64)
    src = src_ptr + layer * stride_src_l + kv * stride_src_kv + src_block * BLOCK_NUMEL
    dst = dst_ptr + layer * stride_dst_l + kv * stride_dst_kv + dst_block * BLOCK_NUMEL
    for start in range(0, BLOCK_NUMEL, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def check_copy_args(src: torch.Tensor, dst: torch.Tensor, layer_start: int, layer_end: int,
                    src_ids: torch.Tensor, dst_ids: torch.Tensor, peer: bool = False) -> None:
    """ValueError unless src and dst are contiguous pools of one dtype, device, layer count and
    block shape, the layer range lies in them, and the ids are two 1-D integer lists of one
    length on that device; with `peer`, the pools may be on other CUDA devices than the ids'.
    Block ids are not range-checked: that would synchronise."""
    if src.dim() != 6 or dst.dim() != 6 or src.shape[1] != 2:
        raise ValueError(f"KV pools must be [L, 2, N, block_size, Hkv, D]; got src "
                         f"{tuple(src.shape)}, dst {tuple(dst.shape)}")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} may differ only in "
                         "the number of blocks (dim 2)")
    if src.dtype != dst.dtype or src.dtype not in KV_DTYPES:
        raise ValueError(f"src and dst need one dtype of {KV_DTYPES}; got {src.dtype}, "
                         f"{dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if not 0 <= layer_start <= layer_end <= src.shape[0]:
        raise ValueError(f"layers [{layer_start}, {layer_end}) are not within the pools' "
                         f"{src.shape[0]} layers")
    if src_ids.dim() != 1 or src_ids.shape != dst_ids.shape:
        raise ValueError(f"src_ids and dst_ids must be 1-D of one length; got "
                         f"{tuple(src_ids.shape)}, {tuple(dst_ids.shape)}")
    if src_ids.dtype not in ID_DTYPES or dst_ids.dtype not in ID_DTYPES:
        raise ValueError(f"block ids must be int64 or int32; got {src_ids.dtype}, "
                         f"{dst_ids.dtype}")
    ids_gpu = src_ids.is_cuda and src_ids.device == dst_ids.device
    if peer and src.is_cuda and dst.is_cuda and ids_gpu:
        return
    if not src.device == dst.device == src_ids.device == dst_ids.device:
        raise ValueError(f"pools and ids must share a device; got src {src.device}, dst "
                         f"{dst.device}, src_ids {src_ids.device}, dst_ids {dst_ids.device}")


def copy_kv_blocks(src: torch.Tensor, dst: torch.Tensor, layer_start: int, layer_end: int,
                   src_ids: torch.Tensor, dst_ids: torch.Tensor, *, block: int = 8192,
                   num_warps: int = 8, peer: bool = False) -> None:
    """dst[l, kv, dst_ids[i]] = src[l, kv, src_ids[i]] for l in [layer_start, layer_end),
    kv in (0, 1), every i. Mutates dst only. Launch only (no synchronize); runs on the current
    CUDA stream. Ids must be in range and dst_ids distinct; if src is dst, the two id lists must
    not share a block. The Triton kernel runs on CUDA (and on CPU under TRITON_INTERPRET=1),
    the torch reference elsewhere. `block` (elements a program moves per step) and `num_warps`
    tune the kernel (pdserve/bench/gpu_kv_copy.py times them: on an H100, 1B-shaped blocks of
    16 KiB, 8192 x 8 warps moved 0.43 / 0.95 / 0.97 of a contiguous copy_'s bytes per second at
    1k / 4k / 16k tokens, 2048 x 4 0.34 / 0.93 / 0.96). `peer`: src or dst may sit on
    another GPU of this host that the ids' GPU reaches as a peer (a pool mapped by CUDA IPC,
    peer access enabled): the kernel runs on the ids' GPU and reads or writes it directly over
    NVLink or PCIe, one pass over the bytes; between two H200s these settings store into (or
    load from) the other GPU's memory at 0.95-1.05x a peer `copy_`, and no other setting of a
    sweep did better, several blocks a program included (`python -m pdserve.bench.gpu_kv_copy
    --peer`, 2026-11-28)."""
    check_copy_args(src, dst, layer_start, layer_end, src_ids, dst_ids, peer)
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of 2; got {block}")
    n, num_layers = src_ids.numel(), layer_end - layer_start
    if n == 0 or num_layers == 0:
        return
    if not (src.is_cuda or (INTERPRET and src.device.type == "cpu")):
        ref_copy_kv_blocks(src, dst, layer_start, layer_end, src_ids, dst_ids)
        return
    block_numel = src[0, 0, 0].numel()
    on_ids_gpu = torch.cuda.device(src_ids.device) if src_ids.is_cuda else contextlib.nullcontext()
    with on_ids_gpu:  # the GPU the kernel runs on
        _copy_blocks_kernel[(n, 2, num_layers)](
            as_bytes(src), as_bytes(dst), src_ids, dst_ids, layer_start,
            src_ids.stride(0), dst_ids.stride(0),
            src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            BLOCK_NUMEL=block_numel, BLOCK=min(block, triton.next_power_of_2(block_numel)),
            num_warps=num_warps,
        )


def ref_copy_kv_blocks(src: torch.Tensor, dst: torch.Tensor, layer_start: int, layer_end: int,
                       src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Reference (and the CPU path): gather the blocks, then scatter them. Mutates dst."""
    layers = slice(layer_start, layer_end)
    blocks = src[layers].index_select(2, src_ids.long())  # [l, 2, n, block_size, Hkv, D]
    index_copy_kv(dst[layers], 2, dst_ids.long(), blocks)
