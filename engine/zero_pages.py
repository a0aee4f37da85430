"""Zero-filled host tensors whose memory is taken page by page, on first write.

A CPU KV cache is sized for the longest and fullest batches, and most of it stays unwritten until
requests fill it. `torch.zeros` writes every byte up front, so the whole pool is resident from the
start. A private anonymous mapping reads as zeros and the kernel backs each page with memory on
its first write: the pool's resident size follows the blocks actually written (a step writes the
slots of its tokens only), and an idle server with a big cache holds what it has used. The bytes
read are the same zeros either way. On CUDA the allocation is the caching allocator's, as before.
"""

from __future__ import annotations

import math
import mmap
import os

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor of `shape`; on the CPU backed by an anonymous mapping (see the docstring)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_PRIVATE: a forked child gets its own copy-on-write view, not a shared pool.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping alive (frombuffer keeps a reference to its buffer).
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A zeroed CPU tensor of `shape` in a memfd, and the memfd (the caller closes it once
    other processes have it: the mapping stays)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create("pdserve-kv-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return map_shared(fd, shape, dtype), fd
    except BaseException:
        os.close(fd)
        raise


def map_shared(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor `shared_zeros` made, mapped from its memfd `fd` (in any process)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
