"""kernels/w4a16_gemv_kmajor.py against kernels/w4a16.py's reference: steps within one group
and across several, rows past N, act dtypes; the launcher's checks."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import random_w4a16_layout, rel_err

from kernels.w4a16 import w4a16_ref
from kernels.w4a16_gemv_kmajor import kmajor_layout, w4a16_gemv_kmajor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("mkn,group,blocks", [
    ((1, 64, 48), 32, (8, 32)),  # a step is one group
    ((3, 128, 40), 32, (16, 128)),  # four groups a step; 40 rows in tiles of 16
    ((2, 96, 72), 8, (4, 32)),  # groups of 8: a scale per word
    ((1, 256, 24), 256, (8, 64)),  # a group spans four steps
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(mkn, group: int, blocks, dtype: torch.dtype) -> None:
    m, k, n = mkn
    qweight, scales, zeros = random_w4a16_layout(k, n, group, seed=m * k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    layout = [t.to(DEVICE) for t in kmajor_layout(qweight, scales, zeros)]
    out = w4a16_gemv_kmajor(x.to(DEVICE), *layout, group, block_n=blocks[0], block_k=blocks[1])
    assert out.dtype == dtype and out.shape == (m, n)
    ref = w4a16_ref(x, qweight, scales, zeros, group)
    assert rel_err(out.cpu(), ref) < TOLERANCE[dtype]


def test_launcher_checks_its_inputs() -> None:
    qweight, scales, zeros = kmajor_layout(*random_w4a16_layout(64, 16, 32, seed=1))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="need"):
        w4a16_gemv_kmajor(x, qweight, scales.half(), zeros, 32)
    with pytest.raises(ValueError, match="need"):
        w4a16_gemv_kmajor(x, qweight, scales, zeros, 32, block_k=48)  # not a power of two
    with pytest.raises(ValueError, match="need"):
        w4a16_gemv_kmajor(torch.randn(1, 56), qweight, scales, zeros, 32)  # K off the codes
    assert w4a16_gemv_kmajor(torch.randn(0, 64), qweight, scales, zeros, 32).shape == (0, 16)
