"""kernels/argmax.py against torch.argmax: chunk edges, ties (the lowest id wins, as torch),
rows of -inf, a vocabulary that is not a multiple of the chunk; on CPU through the interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.argmax import argmax_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_argmax_rows_equals_torch_argmax(dtype):
    vocab, block = 1000, 256  # 4 chunks, the last one short
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(7, vocab, generator=gen).to(dtype)
    logits[1, 255] = logits[1, 256] = 50  # a tie across a chunk edge
    logits[2, 999] = 50  # the last id, in the short chunk
    logits[3, [7, 700, 900]] = 50  # a three-way tie in different chunks
    logits[4] = float("-inf")  # nothing allowed: torch answers 0
    logits[5, 0] = 50
    logits[6, 600] = float("nan")  # a broken row still names an id in range: the NaN's
    logits = logits.to(DEVICE)
    out = argmax_rows(logits, block=block)
    assert out.dtype == torch.int64
    assert out.tolist() == logits.argmax(dim=-1).tolist() == [
        int(logits[0].float().argmax()), 255, 999, 7, 0, 0, 600]


def test_bf16_rows_whose_values_tie_only_after_rounding():
    """bf16 logits compare as they are, not as the fp32 values they were rounded from."""
    fp32 = torch.zeros(1, 300)
    fp32[0, 10], fp32[0, 290] = 3.0001, 3.0002  # both round to 3.0 in bf16
    logits = fp32.to(torch.bfloat16).to(DEVICE)
    assert argmax_rows(logits, block=128).tolist() == logits.argmax(dim=-1).tolist() == [10]
