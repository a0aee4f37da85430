"""engine/structured/bitmask.py: xgrammar's int32 word masks onto logits, on the CPU and on CUDA
where there is one (no grammar engine needed)."""

from __future__ import annotations

import pytest
import torch

from engine.structured.bitmask import bitmask_words

V = 1500  # not a multiple of 32: the last word is partial


def _bitmask(allowed: list[set[int]]) -> torch.Tensor:
    mask = torch.zeros(len(allowed), bitmask_words(V), dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for t in ids:
            mask[r, t // 32] |= 1 << (t % 32)
    return mask.to(torch.int32)  # bit 31 wraps to the sign, as xgrammar's int32 words do


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_mask_logits_keeps_allowed_logits_exactly_and_the_rest_at_minus_inf(device):
    from engine.structured.bitmask import mask_logits

    gen = torch.Generator().manual_seed(4)
    sets = [{0, 7, 8, 31, 32, 1499}, set(range(V)), set(), {V - 1}]
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(len(sets), V, generator=gen) * 5).to(dtype)
        before = logits.clone()
        masked = mask_logits(logits.to(device), _bitmask(sets)).cpu()
        assert torch.equal(logits, before) and masked.dtype == dtype  # a copy
        for r, s in enumerate(sets):
            keep = torch.zeros(V, dtype=torch.bool)
            keep[list(s)] = True
            assert torch.equal(masked[r][keep], logits[r][keep])
            assert bool((masked[r][~keep] == float("-inf")).all())
