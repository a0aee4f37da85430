"""Rotary position embedding applied in place to q and k (HF's rotate_half convention).

NOTE: one program per token rotates all its query and key heads. `cos_sin_cache[pos]` holds
[cos(pos * f_0..f_{D/2-1}) | sin(...)] in fp32, computed once for every position. With the two
halves x1 = x[:D/2], x2 = x[D/2:] of a head:

    x1' = x1 * cos - x2 * sin        x2' = x2 * cos + x1 * sin

computed in fp32, rounded once. Replaces building [T, D] cos/sin tensors and four elementwise
passes per tensor every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(src, dst, cos, sin, num_heads, stride_src_h, stride_dst_h, HEADS_PAD: tl.constexpr,
            HALF: tl.constexpr):
    """Rotate the heads at `src` into `dst` (the same place: in place)."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    first = src + offs_h[:, None] * stride_src_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    tl.store(out, (x1 * cos[None, :] - x2 * sin[None, :]).to(dst.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dst.dtype.element_ty),
             mask=mask)


@triton.jit
def _cos_sin(cache_ptr, pos_ptr, token, HALF: tl.constexpr):
    """cos and sin [HALF] fp32 of `token`'s position."""
    pos = tl.load(pos_ptr + token)
    offs_d = tl.arange(0, HALF)
    return (tl.load(cache_ptr + pos * 2 * HALF + offs_d),
            tl.load(cache_ptr + pos * 2 * HALF + HALF + offs_d))


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    num_heads, num_kv_heads,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cache_ptr, pos_ptr, token, HALF)
    q = q_ptr + token * stride_qt
    k = k_ptr + token * stride_kt
    _rotate(q, q, cos, sin, num_heads, stride_qh, stride_qh, Q_HEADS_PAD, HALF)
    _rotate(k, k, cos, sin, num_kv_heads, stride_kh, stride_kh, K_HEADS_PAD, HALF)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, D] fp32: cos | sin of position * inv_freq (inv_freq [D/2] fp32)."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    cache: torch.Tensor,  # [max_positions, D] fp32 from cos_sin_cache
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding needs contiguous head_dim")
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            num_heads, k.shape[1],
            Q_HEADS_PAD=triton.next_power_of_2(num_heads),
            K_HEADS_PAD=triton.next_power_of_2(k.shape[1]), HALF=head_dim // 2, num_warps=4,
        )


def rotary_embedding_ref(positions, q, k, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (fp32 math, cast back)."""
    half = q.shape[-1] // 2
    cos, sin = cache[positions, :half][:, None, :], cache[positions, half:][:, None, :]

    def rotate(x):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
