"""A decode step's inputs into a CUDA graph's static buffers in one launch.

NOTE: before a decode graph replays, its static buffers take the step's token ids, positions,
slots, lengths and page-table rows for the n real rows, and the padding rows up to the graph's
size get slot -1 and length 0. As torch copies and fills that is five to seven operations on
the GPU's stream (about 1 us each and as much between them on an H100, every token). Here one
program per row of the graph's size does its row's share:

    row < n:   ids, positions, slots, lengths[row] = the step's;  table[row, :width] = its row
    row >= n:  slots[row] = -1, lengths[row] = 0                  (the padding: no store, no
                                                                   context)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET


@triton.jit(do_not_specialize=["n", "width", "stride_src_t"])
def _stage_kernel(
    ids_src, pos_src, slots_src, lens_src, tables_src,  # the step's: [n] x 4, [n, >= width]
    ids_dst, pos_dst, slots_dst, lens_dst, tables_dst,  # the graph's: [size] x 4, [size, W]
    n, width, stride_src_t, stride_dst_t,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    if row < n:
        tl.store(ids_dst + row, tl.load(ids_src + row))
        tl.store(pos_dst + row, tl.load(pos_src + row))
        tl.store(slots_dst + row, tl.load(slots_src + row))
        tl.store(lens_dst + row, tl.load(lens_src + row))
        src = tables_src + row.to(tl.int64) * stride_src_t
        dst = tables_dst + row.to(tl.int64) * stride_dst_t
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            keep = cols < width
            tl.store(dst + cols, tl.load(src + cols, mask=keep), mask=keep)
    else:
        tl.store(slots_dst + row, -1)
        tl.store(lens_dst + row, 0)


def stage_inputs(src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...], n: int,
                 width: int) -> None:
    """`src` = (ids [n], positions [n], slots [n], lengths [n], tables [n, >= width]) into the
    first n rows of `dst` (the same five, of the graph's size), the rest padding (the NOTE).
    Mutates `dst`. The torch path off CUDA, or where a row is strided."""
    size = dst[0].shape[0]
    if not 0 < n <= size or width > dst[4].shape[1] or src[4].shape[0] != n:
        raise ValueError(f"stage_inputs: {n} rows of width {width} into a graph of {size} rows "
                         f"x {dst[4].shape[1]}, tables {tuple(src[4].shape)}")
    rows_contiguous = all(t.stride(-1) == 1 for t in (*src, *dst))
    if not (dst[0].is_cuda or INTERPRET) or not rows_contiguous:
        stage_inputs_ref(src, dst, n, width)
        return
    _stage_kernel[(size,)](
        *src, *dst, n, width, src[4].stride(0), dst[4].stride(0),
        # from the graph's width, not the step's (which grows with its sequences): one compile
        BLOCK_W=min(256, triton.next_power_of_2(max(dst[4].shape[1], 16))), num_warps=1,
    )


def stage_inputs_ref(src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...], n: int,
                     width: int) -> None:
    """The copies and fills one by one."""
    for s, d in zip(src[:4], dst[:4], strict=True):
        d[:n].copy_(s)
    dst[2][n:].fill_(-1)
    dst[3][n:].fill_(0)
    dst[4][:n, :width].copy_(src[4][:, :width])
