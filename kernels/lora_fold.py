"""The expand of a multi-LoRA delta whose shrink rode along in the base projection's GEMV.

NOTE: at decode sizes (engine/lora/layers.py) a LoRA projection keeps the stacked A matrices of
its S slots as extra output rows of the base weight, so ONE GEMV gives the base output y and
every slot's shrink t = A_s x; this kernel then adds each token's B_s t_s (scaling already in B):

    full [T, N + S * n_slices * R]:   | y (N columns) | t of slot 0 | t of slot 1 | ... |
                                                          `- slice 0's R, slice 1's R, ...
    out[t, n] = y[t, n] + sum_r B_s[n, r] * full[t, N + (s * n_slices + slice(n)) * R + r],
                s = slots[t] (out = y for a token of slot -1)

One launch per projection instead of a shrink and an expand (or one fused launch that redoes
the shrink per column chunk); the extra rows cost a 1B layer's GEMVs ~2% more bytes (0.8-6%
per projection). With SWIGLU (a gate_up projection of two equal slices) the SiLU-and-mul
follows in the same program: out[t, j] = silu(g) * u with g, u the rounded columns j and
I + j, as kernels/silu_mul.py.

grid (T, cdiv(N_out, BLOCK_N)): one token row and BLOCK_N output columns per program, fp32
sums rounded once. With USE_PDL (programmatic dependent launch, Hopper) a program loads its
slot and B tile before it waits for the GEMV ahead (both are written before the step starts).
No host sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from kernels._common import INTERPRET
from kernels.lora_kernels import MAX_SLICES, jit, tl, triton

BLOCK_N = 64


@jit
def _lora_fold_expand_kernel(
    full_ptr,  # [T, N + S * n_slices * R]: y, then every slot's t
    b_ptr,  # [S, N, R], scaling multiplied in
    slots_ptr,  # [T] int32, -1: no adapter
    out_ptr,  # [T, N] (SWIGLU: [T, N // 2])
    N, S, R, n_slices,
    o1, o2, o3,  # first columns of slices 1..3 (N where absent)
    stride_fm, stride_bs, stride_bn, stride_om,
    BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    if SWIGLU:
        n_out = N // 2
    else:
        n_out = N
    c_mask = cols < n_out
    offs_r = tl.arange(0, R_PAD)
    slot = tl.load(slots_ptr + m)
    s = tl.where((slot >= 0) & (slot < S), slot, 0).to(tl.int64)
    slot_cols = cols * 0 + slot  # [BN]: masks are blocks (Triton's interpreter insists)
    active = c_mask & (slot_cols >= 0) & (slot_cols < S)
    tb_mask = active[:, None] & (offs_r < R)[None, :]  # [BN, R]
    b_cols = b_ptr + s * stride_bs + offs_r[None, :]
    b = tl.load(b_cols + cols[:, None] * stride_bn, mask=tb_mask, other=0.0)
    if SWIGLU:
        b_up = tl.load(b_cols + (cols + n_out)[:, None] * stride_bn, mask=tb_mask, other=0.0)
    if USE_PDL:  # slot and B are in registers; y and t come from the GEMV ahead
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = full_ptr + m * stride_fm
    t_row = row + N + s * n_slices * R + offs_r[None, :]  # this slot's t, slice 0
    sl = (cols >= o1).to(tl.int32) + (cols >= o2).to(tl.int32) + (cols >= o3).to(tl.int32)
    t = tl.load(t_row + sl[:, None] * R, mask=tb_mask, other=0.0)
    y = tl.load(row + cols, mask=c_mask, other=0.0).to(tl.float32)
    y += tl.sum(b.to(tl.float32) * t.to(tl.float32), axis=1)
    if SWIGLU:  # gate columns j, up columns I + j: slice 0 and 1
        t_up = tl.load(t_row + R, mask=tb_mask, other=0.0)
        up = tl.load(row + n_out + cols, mask=c_mask, other=0.0).to(tl.float32)
        up += tl.sum(b_up.to(tl.float32) * t_up.to(tl.float32), axis=1)
        gate = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + m * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=c_mask)


def _check(full: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
           offsets: tuple[int, ...], swiglu: bool) -> None:
    (num_tokens, width), (slots_n, n, r) = full.shape, lora_b.shape
    n_slices = len(offsets) - 1
    if not 1 <= n_slices <= MAX_SLICES or offsets[0] != 0 or offsets[-1] != n:
        raise ValueError(f"slice_offsets {offsets} must run from 0 to N={n}, 1..4 slices")
    if width != n + slots_n * n_slices * r or slots.shape != (num_tokens,):
        raise ValueError(f"full {tuple(full.shape)} / slots {tuple(slots.shape)} do not fit "
                         f"lora_b {tuple(lora_b.shape)} with {n_slices} slices")
    if swiglu and (n_slices != 2 or 2 * offsets[1] != n):
        raise ValueError(f"swiglu needs two equal slices, got offsets {offsets}")
    if full.dtype != lora_b.dtype or slots.dtype != torch.int32:
        raise ValueError(f"full and lora_b must share a dtype and slots be int32, got "
                         f"{full.dtype} {lora_b.dtype} {slots.dtype}")
    if full.stride(-1) != 1 or lora_b.stride(-1) != 1:
        raise ValueError("full and lora_b need contiguous rows")


def lora_fold_expand(
    full: torch.Tensor,  # [T, N + S * n_slices * R]: the folded GEMV's output
    lora_b: torch.Tensor,  # [S, N, R], scaling multiplied in
    slots: torch.Tensor,  # [T] int32: slot of each token, -1 none
    slice_offsets: tuple[int, ...],  # n_slices + 1 column offsets into y, 0 .. N
    *,
    swiglu: bool = False,  # then silu(gate) * up of the two slices: [T, N // 2]
    pdl: bool = False,  # a programmatic dependent launch (Hopper; kernels/gemv.py)
) -> torch.Tensor:  # [T, N] (swiglu: [T, N // 2]), a new tensor
    """y + B_s t_s for every token (see the NOTE); `lora_fold_expand_ref` off CUDA (unless
    under TRITON_INTERPRET)."""
    _check(full, lora_b, slots, slice_offsets, swiglu)
    if triton is None or not (full.is_cuda or INTERPRET):
        return lora_fold_expand_ref(full, lora_b, slots, slice_offsets, swiglu=swiglu)
    (num_tokens, _), (slots_n, n, r) = full.shape, lora_b.shape
    n_out = n // 2 if swiglu else n
    out = torch.empty(num_tokens, n_out, dtype=full.dtype, device=full.device)
    if num_tokens == 0:
        return out
    starts = list(slice_offsets[1:-1]) + [n] * (MAX_SLICES + 1 - len(slice_offsets))
    _lora_fold_expand_kernel[(num_tokens, triton.cdiv(n_out, BLOCK_N))](
        full, lora_b, slots, out, n, slots_n, r, len(slice_offsets) - 1, *starts,
        full.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_N=BLOCK_N, R_PAD=max(2, triton.next_power_of_2(r)), SWIGLU=swiglu,
        USE_PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )
    return out


def lora_fold_expand_ref(
    full: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
    slice_offsets: tuple[int, ...], *, swiglu: bool = False,
) -> torch.Tensor:
    """lora_fold_expand in torch, any device: fp32 sums rounded once (one host sync)."""
    _check(full, lora_b, slots, slice_offsets, swiglu)
    (slots_n, n, r), n_slices = lora_b.shape, len(slice_offsets) - 1
    out = full[:, :n].clone()
    for s in torch.unique(slots).tolist():
        if not 0 <= s < slots_n:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        t = full[rows, n + s * n_slices * r:n + (s + 1) * n_slices * r].float()
        y = full[rows, :n].float()
        for i, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:])):
            y[:, lo:hi] += t[:, i * r:(i + 1) * r] @ lora_b[s, lo:hi].float().T
        out[rows] = y.to(out.dtype)
    if not swiglu:
        return out
    gate, up = out.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(out.dtype)
