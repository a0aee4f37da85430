"""kernels/fp8_dot_gemv.py (fp8 x fp8 tensor-core decode GEMV) against kernels/fp8.py
`scaled_mm_ref` under Triton's interpreter: token counts up to the dot's 16, rows past a tile,
a bias, split K's atomic partial sums, and the launcher's refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.quant.fp8 import quantize_weight  # noqa: E402
from kernels.fp8 import quantize_rows_ref, scaled_mm_ref  # noqa: E402
from kernels.fp8_dot_gemv import fp8_dot_gemv  # noqa: E402


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.5, 4.0, m)[:, None]
    w = torch.randn(n, k, generator=g) * torch.linspace(0.1, 3.0, n)[:, None]
    xq, sx = quantize_rows_ref(x)
    q = quantize_weight(w)
    return xq, sx, q.qweight, q.scale


@pytest.mark.parametrize("m,split_k", [(1, 1), (5, 1), (16, 1), (3, 4)])
def test_dot_gemv_matches_the_scaled_mm_reference(m, split_k):
    n, k = 37, 256  # 37 rows: the last tile is partly past N
    xq, sx, qw, sw = _operands(m, n, k, seed=m)
    bias = torch.randn(n)
    y = fp8_dot_gemv(xq, sx, qw, sw, bias, torch.float32, block_n=16, block_k=32,
                     num_stages=2, split_k=split_k)
    ref = scaled_mm_ref(xq, sx, qw, sw, torch.float32) + bias
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    y16 = fp8_dot_gemv(xq, sx, qw, sw, None, torch.bfloat16, block_n=16, block_k=64,
                       num_stages=2)
    torch.testing.assert_close(y16, scaled_mm_ref(xq, sx, qw, sw, torch.bfloat16),
                               rtol=1e-2, atol=1e-2)


def test_dot_gemv_refuses_what_it_cannot_compute():
    xq, sx, qw, sw = _operands(2, 16, 64, seed=0)
    with pytest.raises(ValueError, match="K a multiple of BLOCK_K"):
        fp8_dot_gemv(xq, sx, qw, sw, block_k=128)
    with pytest.raises(ValueError, match="need fp8"):
        fp8_dot_gemv(xq.float(), sx, qw, sw, block_k=32)
    with pytest.raises(ValueError, match="out_dtype float32"):
        fp8_dot_gemv(xq, sx, qw, sw, block_k=32, split_k=2)
    many, many_s = quantize_rows_ref(torch.randn(17, 64))
    with pytest.raises(ValueError, match="M <= 16"):
        fp8_dot_gemv(many, many_s, qw, sw, block_k=32)
