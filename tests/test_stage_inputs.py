"""kernels/stage_inputs.py: a decode step's inputs into a graph's static buffers in one launch,
against the copies and fills one by one (Triton's interpreter on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kernels.stage_inputs import stage_inputs, stage_inputs_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _buffers(size, width, fill):
    return (torch.full((size,), fill, dtype=torch.int64), torch.full((size,), fill),
            torch.full((size,), fill), torch.full((size,), fill, dtype=torch.int32),
            torch.full((size, width), fill, dtype=torch.int32))


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors: needs the interpreter")
@pytest.mark.parametrize(("n", "size", "width"), [(3, 4, 5), (4, 4, 5), (1, 8, 290)])
def test_stage_kernel_equals_the_copies_and_pads_the_rest(n, size, width):
    """Rows of a table wider than one step of the kernel's loop (290 of 300) too."""
    wide = width + 10
    gen = torch.Generator().manual_seed(n * 10 + size)
    src = (torch.randint(0, 1000, (n,), generator=gen), torch.randint(0, 99, (n,), generator=gen),
           torch.randint(0, 500, (n,), generator=gen),
           torch.randint(1, 99, (n,), generator=gen, dtype=torch.int32),
           torch.randint(0, 64, (n, wide + 1), generator=gen, dtype=torch.int32))
    src = tuple(t.to(DEVICE) for t in src)
    got = tuple(t.to(DEVICE) for t in _buffers(size, wide, 77))
    want = tuple(t.to(DEVICE) for t in _buffers(size, wide, 77))
    stage_inputs(src, got, n, width)
    stage_inputs_ref(src, want, n, width)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert got[2][n:].eq(-1).all() and got[3][n:].eq(0).all()  # padding: no slot, no context
    assert got[4][:, width:].eq(77).all()  # columns past the width are left as they were


def test_stage_refuses_more_rows_than_the_graph():
    src = _buffers(3, 4, 1)
    with pytest.raises(ValueError, match="3 rows"):
        stage_inputs(src, _buffers(2, 4, 0), 3, 4)
