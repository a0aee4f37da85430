"""An fp8 KV cache (`kv_cache_dtype="fp8"`, vLLM's name): K and V stored as float8_e4m3fn with
one fp32 scale per tensor (k_scale, v_scale), the torch side of it.

NOTE: the cache holds x / scale, saturated to e4m3's range, rounded once; attention reads it
back as the stored value (exact in bf16, fp16 and fp32) times the scale:

    store   q = cast_e4m3(clamp(x / scale, -448, 448))         (kernels/kv_store.py, rope_store.py)
    read    x ~= float(q) * scale                               (paged decode / prefill attention)

Without calibration the scales are 1.0 (vLLM's default k_scale = v_scale = 1.0): the cache
keeps K and V as they come, to e4m3's 3 mantissa bits (a relative error up to 2**-4), and
values beyond +-448 saturate. The scales describe an fp8 cache only: a cache of the model's
dtype is stored and read as it is.

torch on the CPU casts and copies fp8 tensors but lacks some kernels for them (index_copy_):
`as_bytes` views a 1-byte cache as uint8, where every copy works and moves the same bytes.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8 as KV_FP8
from kernels.fp8 import FP8_MAX

__all__ = ["KV_FP8", "FP8_MAX", "as_bytes", "check_scales", "dequantize_kv", "index_copy_kv",
           "is_fp8", "quantize_kv"]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == KV_FP8


def check_scales(op: str, cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """ValueError unless the scales are positive, and 1.0 for a cache that is not fp8."""
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"{op}: k_scale and v_scale must be > 0, got {k_scale}, {v_scale}")
    if not is_fp8(cache_dtype) and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"{op}: k_scale/v_scale apply to an fp8 KV cache; this one is "
                         f"{cache_dtype}")


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: fp8 (x / scale, saturated), or x in the cache's dtype."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache values read back in `dtype`: fp8 times the scale (in fp32), others as they are."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte float tensor (fp8) viewed as uint8, the same strides and bytes; others as they
    are."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def index_copy_kv(dst: torch.Tensor, dim: int, ids: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(dim, ids, src) for any KV dtype (fp8 through uint8 views). Mutates dst."""
    if src.dtype != dst.dtype:
        raise ValueError(f"index_copy_kv: src {src.dtype} into dst {dst.dtype}")
    as_bytes(dst).index_copy_(dim, ids, as_bytes(src))
