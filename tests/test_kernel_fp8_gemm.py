"""kernels/fp8_gemm.py (fp8 x fp8 GEMM, split K by tickets) against kernels/fp8.py
`scaled_mm_ref`, under Triton's interpreter on the CPU: M past a row tile (1, 17, 40), K and N
multiples of 16 but not of the blocks, 1 to 3 K shares (the last one short), bf16 and fp32 out, a
zero row; the default launch's heuristic; the launcher's refusals.

Tolerances: an accumulator's rounding is bounded by the sum of the products' magnitudes
(sum_k |x w| times the scales, `_within`), not by the result, which cancellation can make small.
The products of two fp8 values are exact in fp32; under the interpreter both sides sum them in
fp32, in different orders (the dots widen the tiles to fp32: kernels/fp8_gemm.py NOTE): 1e-6 of
the magnitude. On a GPU, 64-row and larger tiles take wgmma, whose fp8 sum keeps fewer bits (the
fast accumulation of torch._scaled_mm(use_fast_accum=True): on an H100, 2026-12-07, both were
off by up to 5e-4 of the magnitude at K 8192 and 2e-4 at K 208, the same elements;
`python -m pdserve.bench.fp8_gemm_error`): 2e-3 there. bf16 outputs are the fp32 ones rounded
once (to nearest on a GPU; the interpreter truncates), so one bf16 step (at most 2^-7 of the
value) more."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.fp8 import FP8, scaled_mm_magnitude, scaled_mm_ref  # noqa: E402
from kernels.fp8_gemm import Fp8GemmConfig, default_config, fp8_gemm, split_plan  # noqa: E402
from pdserve.bench.fp8_gemm_error import operands  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OF_MAGNITUDE = 2e-3 if CUDA else 1e-6


def _within(y: torch.Tensor, xq, sx, wq, sw) -> None:
    """y within the accumulation's bound of `scaled_mm_ref` (see the module's docstring)."""
    ref = scaled_mm_ref(xq, sx.reshape(-1, 1), wq, sw, torch.float32)
    magnitude = scaled_mm_magnitude(xq, sx.reshape(-1, 1), wq, sw)
    bound = OF_MAGNITUDE * magnitude + 1e-6
    if y.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-7
    excess = (y.float() - ref).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} of {y.numel()} out of bounds"


def _operands(m: int, n: int, k: int, seed: int, zero_row: int | None = None):
    return operands(m, n, k, seed, DEVICE, zero_row)


# (M, N, K), the launch: BLOCK_K 32 leaves K = 80 / 208 a partial last step, BLOCK_N 32 leaves
# N = 48 a partial column tile; K 208 in 3 shares of 96, 96 and 16
CASES = [
    ((1, 48, 80), Fp8GemmConfig(16, 32, 32, split_k=1)),
    ((17, 48, 80), Fp8GemmConfig(16, 32, 32, split_k=2)),
    ((40, 48, 208), Fp8GemmConfig(16, 32, 32, split_k=3)),
    ((17, 64, 256), Fp8GemmConfig(32, 16, 64, split_k=2)),  # EVEN_K: no K masks
    ((40, 32, 96), Fp8GemmConfig(64, 32, 32, split_k=1)),  # one row tile, 24 rows past M
]


@pytest.mark.parametrize("mnk,config", CASES, ids=[c.label for _, c in CASES])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_matches_the_scaled_mm_reference(mnk, config, out_dtype):
    m, n, k = mnk
    xq, sx, wq, sw = _operands(m, n, k, seed=m + k, zero_row=m // 2)
    y = fp8_gemm(xq, sx, wq, sw, out_dtype, config)
    ref = scaled_mm_ref(xq, sx, wq, sw, out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n) and ref.shape == y.shape
    _within(y, xq, sx, wq, sw)
    assert torch.count_nonzero(y[m // 2]) == 0  # the zero row


def test_split_k_is_repeatable_and_leaves_its_tickets_for_the_next_call():
    xq, sx, wq, sw = _operands(17, 48, 208, seed=3)
    config = Fp8GemmConfig(16, 32, 32, split_k=3)
    first = fp8_gemm(xq, sx, wq, sw, torch.float32, config)
    again = fp8_gemm(xq, sx, wq, sw, torch.float32, config)
    assert torch.equal(first, again)  # parts summed in share order, whoever arrives last
    one = fp8_gemm(xq, sx, wq, sw, torch.float32, Fp8GemmConfig(16, 32, 32, split_k=1))
    torch.testing.assert_close(first, one, rtol=1e-5, atol=1e-4)


def test_default_launch_and_a_one_dimensional_x_scale():
    xq, sx, wq, sw = _operands(5, 32, 64, seed=7)
    y = fp8_gemm(xq, sx.reshape(5), wq, sw)
    assert y.dtype == torch.bfloat16
    _within(y, xq, sx, wq, sw)
    assert fp8_gemm(xq[:0], sx[:0], wq, sw).shape == (0, 32)


def test_split_plan_counts_whole_steps_per_share():
    config = Fp8GemmConfig(16, 32, 32, split_k=3)
    plan = split_plan(40, 48, 208, config)  # 7 steps of 32: shares of 3, 3 and 1 (half) steps
    assert (plan.tiles, plan.split, plan.k_per_split) == ((3, 2), 3, 96)
    plan = split_plan(40, 48, 112, config)  # 4 steps: shares of 2 and 2, not 2, 1, 1
    assert (plan.split, plan.k_per_split) == (2, 64)
    assert split_plan(1, 16, 32, Fp8GemmConfig(16, 16, 32, split_k=8)).split == 1


def test_default_config_splits_k_only_where_tiles_leave_sms_idle():
    sms = 132  # an H100 / H200
    qkv, o, gate_up, down = (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)
    at_256 = [default_config(256, n, k, sms) for n, k in (qkv, o, gate_up, down)]
    assert [c.split_k for c in at_256] == [2, 4, 1, 4]  # 48, 32, 256, 32 tiles of 128 x 128
    assert {(c.block_m, c.block_n, c.block_k, c.warps, c.stages) for c in at_256} == {
        (128, 128, 128, 8, 3)}
    at_64 = [default_config(64, n, k, sms) for n, k in (qkv, down)]
    assert [(c.block_m, c.split_k) for c in at_64] == [(64, 4), (64, 8)]  # 24 and 16 tiles
    assert default_config(256, *down, sm_count=1).split_k == 1  # the CPU
    assert default_config(4096, *down, sms).split_k == 1


def test_bad_operands_are_named():
    xq, sx, wq, sw = _operands(4, 32, 64, seed=1)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(xq.float(), sx, wq, sw)
    with pytest.raises(ValueError, match="same K"):
        fp8_gemm(xq[:, :32], sx, wq, sw)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        fp8_gemm(xq, sx, wq.t().contiguous().t(), sw)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_gemm(xq, sx[:3], wq, sw)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemm(xq, sx, wq, sw.half())
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm(xq, sx, wq, sw, out_dtype=FP8)
    with pytest.raises(ValueError, match="block_k 16"):
        Fp8GemmConfig(16, 16, 16)
    with pytest.raises(ValueError, match="split_k 0"):
        Fp8GemmConfig(16, 16, 32, split_k=0)
