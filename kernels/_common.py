"""Settings shared by the kernels' launchers."""

from __future__ import annotations

import os

import torch

# Under TRITON_INTERPRET=1 (CPU tests) Triton 3.x computes tl.dot of bf16/fp16 operands wrongly
# (garbage of order 1e10, seen with triton 3.9 + numpy 2.4), while fp32 dots are right. Kernels
# take an UPCAST flag and widen their dot operands to fp32 there; on a GPU they stay 16-bit.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (the fp32 path must agree with HF token for token);
    16-bit inputs run on the tensor cores, where the precision setting does not apply."""
    return "ieee" if dtype == torch.float32 or INTERPRET else "tf32"


def check_paged_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The attention kernels index K and V with one set of strides and read head_dim rows as
    contiguous vectors."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with contiguous head_dim")
