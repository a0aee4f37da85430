"""kernels/w4a16_gemv_kmajor.py against kernels/w4a16.py's reference: steps within one group
and across several, rows past N, act dtypes; the launcher's checks."""

from __future__ import annotations

import pytest
import torch

from kernels.w4a16 import pack_rows, w4a16_ref
from kernels.w4a16_gemv_kmajor import kmajor_layout, w4a16_gemv_kmajor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _weights(k: int, n: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 17, (k // group, n), generator=gen).to(torch.uint8)
    return pack_rows(codes), scales, zeros


@pytest.mark.parametrize("mkn,group,blocks", [
    ((1, 64, 48), 32, (8, 32)),  # a step is one group
    ((3, 128, 40), 32, (16, 128)),  # four groups a step; 40 rows in tiles of 16
    ((2, 96, 72), 8, (4, 32)),  # groups of 8: a scale per word
    ((1, 256, 24), 256, (8, 64)),  # a group spans four steps
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(mkn, group: int, blocks, dtype: torch.dtype) -> None:
    m, k, n = mkn
    qweight, scales, zeros = _weights(k, n, group, seed=m * k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    layout = [t.to(DEVICE) for t in kmajor_layout(qweight, scales, zeros)]
    out = w4a16_gemv_kmajor(x.to(DEVICE), *layout, group, block_n=blocks[0], block_k=blocks[1])
    assert out.dtype == dtype and out.shape == (m, n)
    ref = w4a16_ref(x, qweight, scales, zeros, group)
    err = ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOLERANCE[dtype]


def test_launcher_checks_its_inputs() -> None:
    qweight, scales, zeros = kmajor_layout(*_weights(64, 16, 32, seed=1))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="need"):
        w4a16_gemv_kmajor(x, qweight, scales.half(), zeros, 32)
    with pytest.raises(ValueError, match="need"):
        w4a16_gemv_kmajor(x, qweight, scales, zeros, 32, block_k=48)  # not a power of two
    with pytest.raises(ValueError, match="need"):
        w4a16_gemv_kmajor(torch.randn(1, 56), qweight, scales, zeros, 32)  # K off the codes
    assert w4a16_gemv_kmajor(torch.randn(0, 64), qweight, scales, zeros, 32).shape == (0, 16)
