"""Sampling one token per row from temperature-scaled logits, in two launches: the fused form of
`engine/token_choice.py`'s softmax and two-level CDF inversion (`invert_cdf_at`).

NOTE: torch spends ~40 small ops per sampled step on that inversion (block sums, float64
cumsums, searchsorted, gathers): at batch 64 on an H100 they were ~30% of the engine's host time
per step. Here the vocabulary is cut into CDF blocks of BLOCK tokens (256, as torch's path):

    pass 1, grid (M, cdiv(NB, GROUP)):  for each of its GROUP blocks, x = logits / T,
                                        m_b = max x, s_b = sum exp(x - m_b)
    pass 2, grid (M,):                  the row's max m = max m_b; block masses
                                        mass_b = s_b exp(m_b - m) (fp32, then float64);
                                        their cdf; the block b whose interval holds
                                        u * total (the first with cdf > target); where in it
                                        (within, in [0, 1)); then that block's tokens'
                                        exp(x - m_b) in float64, their cdf, and the token whose
                                        interval holds within * their total

so a row reads its logits once plus one block, and no [M, V] probability tensor is written.
A distribution scaled by a constant inverts to the same token, so masses need no 1 / Z; the
rounding differs from torch's (other summation orders), so the two agree except where a uniform
falls within rounding of an interval's edge. Zero-mass tokens and blocks (-inf logits) have
empty intervals and are never chosen; `u` in [0, 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # tokens per CDF block (engine/token_choice.py CDF_BLOCK)
GROUP = 8  # blocks per program of pass 1


@triton.jit
def _block_mass_kernel(x_ptr, temp_ptr, m_ptr, s_ptr, vocab, stride_row, num_blocks,
                       BLOCK: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUP
    blocks = first + tl.arange(0, GROUP)  # [G]
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [G, B]
    inv_t = 1.0 / tl.load(temp_ptr + row)
    x = tl.load(x_ptr + row * stride_row + offs, mask=offs < vocab,
                other=float("-inf")).to(tl.float32) * inv_t
    m = tl.max(x, axis=1)  # [G]
    finite = m > float("-inf")
    e = tl.exp(x - tl.where(finite, m, 0.0)[:, None])  # -inf logits give 0
    s = tl.where(finite, tl.sum(e, axis=1), 0.0)
    keep = blocks < num_blocks
    tl.store(m_ptr + row * num_blocks + blocks, m, mask=keep)
    tl.store(s_ptr + row * num_blocks + blocks, s, mask=keep)


@triton.jit
def _invert_kernel(x_ptr, temp_ptr, u_ptr, m_ptr, s_ptr, out_ptr, vocab, stride_row, num_blocks,
                   BLOCK: tl.constexpr, NB_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nb = tl.arange(0, NB_PAD)
    inside = nb < num_blocks
    m_b = tl.load(m_ptr + row * num_blocks + nb, mask=inside, other=float("-inf"))
    s_b = tl.load(s_ptr + row * num_blocks + nb, mask=inside, other=0.0)
    m = tl.max(m_b, axis=0)
    mass = tl.where(m_b > float("-inf"), s_b * tl.exp(m_b - m), 0.0).to(tl.float64)  # [NB]
    u = tl.load(u_ptr + row)  # float64
    block, within = _find(mass, u, NB_PAD)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    inv_t = 1.0 / tl.load(temp_ptr + row)
    x = tl.load(x_ptr + row * stride_row + offs, mask=offs < vocab,
                other=float("-inf")).to(tl.float32) * inv_t
    block_max = tl.sum(tl.where(nb == block, m_b, 0.0), axis=0)
    p = tl.exp(x - block_max).to(tl.float64)  # [B]: this block's masses, up to a constant
    token, _ = _find(p, within, BLOCK)
    tl.store(out_ptr + row, (block * BLOCK + token).to(tl.int64))


@triton.jit
def _find(mass, u, N: tl.constexpr):
    """For float64 `mass` [N] (some positive) and u in [0, 1]: the index of the interval that
    holds u * total on the cdf (the first entry whose cdf exceeds it; never a zero-mass one),
    and where in that interval it lies, in [0, 1]."""
    idx = tl.arange(0, N)
    cdf = tl.cumsum(mass, axis=0)
    total = tl.max(cdf, axis=0)
    target = u * total
    last = tl.max(tl.where(mass > 0, idx, -1), axis=0)  # u * total may round up to total
    at = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), last)
    before = tl.sum(tl.where(idx == at - 1, cdf, 0.0), axis=0)
    width = tl.sum(tl.where(idx == at, mass, 0.0), axis=0)
    return at, tl.maximum((target - before) / width, 0.0)  # may round to 1: `last` then holds


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
                ) -> torch.Tensor:
    """[M] token ids: row i of `logits` [M, V] divided by `temperature` [M] (float32, > 0),
    softmaxed, inverted at `uniform` [M] (float64 in [0, 1)). Every row needs a finite logit."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample_rows needs contiguous rows")
    if temperature.shape != (rows,) or uniform.shape != (rows,):
        raise ValueError(f"temperature {tuple(temperature.shape)} and uniform "
                         f"{tuple(uniform.shape)} need one value per row ({rows})")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_blocks = triton.cdiv(vocab, BLOCK)
    m = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    temperature = temperature.to(torch.float32)
    uniform = uniform.to(torch.float64)
    _block_mass_kernel[(rows, triton.cdiv(num_blocks, GROUP))](
        logits, temperature, m, s, vocab, logits.stride(0), num_blocks,
        BLOCK=BLOCK, GROUP=GROUP, num_warps=4)
    _invert_kernel[(rows,)](
        logits, temperature, uniform, m, s, out, vocab, logits.stride(0), num_blocks,
        BLOCK=BLOCK, NB_PAD=triton.next_power_of_2(num_blocks), num_warps=4)
    return out
