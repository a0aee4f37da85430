"""The kernels that quantize the activations they make for an FP8 projection (kernels/
rmsnorm_fp8.py, kernels/silu_mul_fp8.py): bit for bit the unfused pair of kernels (the norm or
SwiGLU, then kernels/fp8_quant.py), and within rounding of their torch references; on the CPU
through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.fp8 import FP8  # noqa: E402
from kernels.fp8_quant import MAX_BLOCK, quantize_rows  # noqa: E402
from kernels.rmsnorm import rms_norm  # noqa: E402
from kernels.rmsnorm_fp8 import rms_norm_fp8, rms_norm_fp8_ref  # noqa: E402
from kernels.silu_mul import silu_and_mul  # noqa: E402
from kernels.silu_mul_fp8 import silu_mul_fp8, silu_mul_fp8_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-5


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == FP8:  # compared as bytes: -0 and +0 too
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b)


def assert_near_ref(q: torch.Tensor, scale: torch.Tensor, q_ref: torch.Tensor,
                    scale_ref: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernels' norm / SwiGLU differ from torch's by rounding (bf16 casts in the
    interpreter, rsqrt, the order of the sum), so the scale by up to two ulps of x's dtype and
    each code by at most one e4m3 step at its magnitude (2^-9 below the normal range)."""
    torch.testing.assert_close(scale.cpu(), scale_ref.cpu(), atol=0,
                               rtol=max(2 * torch.finfo(dtype).eps, 1e-6))
    a, b = q.cpu().float(), q_ref.cpu().float()
    magnitude = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-6)
    step = torch.exp2(torch.floor(torch.log2(magnitude)) - 3)
    assert ((a - b).abs() <= step).all()


# ---- RMSNorm -> FP8 rows ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [40, 200, 2100])  # one BLOCK, a masked tail, 8 warps
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_the_norm_then_quantize_rows(dtype, hidden, with_residual):
    x, res = randn(4, hidden, dtype=dtype, seed=1), randn(4, hidden, dtype=dtype, seed=2)
    x[1], res[1] = 0, 0  # an all-zero row: the floor scale, zero codes
    w = randn(hidden, dtype=dtype, seed=3, scale=1.0)  # negative weights too
    residual = res if with_residual else None
    x_before, res_before = x.clone(), res.clone()
    q, scale, new_res = rms_norm_fp8(x, w, EPS, residual)
    assert q.dtype == FP8 and q.shape == (4, hidden) and scale.shape == (4, 1)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched

    normed, want_res = rms_norm(x, w, EPS, residual) if with_residual else (rms_norm(x, w, EPS), x)
    want_q, want_scale = quantize_rows(normed)
    assert_bits_equal(q, want_q)
    assert_bits_equal(scale, want_scale)
    assert_bits_equal(new_res, want_res)

    q_ref, scale_ref, res_ref = rms_norm_fp8_ref(x, w, EPS, residual)
    assert_near_ref(q, scale, q_ref, scale_ref, dtype)
    assert scale[1].item() == scale_ref[1].item() and not q[1].float().any()
    if with_residual:  # one rounded add (the interpreter's bf16 cast truncates: an ulp off)
        torch.testing.assert_close(new_res, res_ref, rtol=2 * torch.finfo(dtype).eps, atol=0)


def test_rms_norm_fp8_of_strided_rows_and_of_no_rows():
    x = randn(72, 3, dtype=torch.bfloat16, seed=4).t()  # [3, 72], rows not contiguous
    res = randn(72, 3, dtype=torch.bfloat16, seed=5).t()
    w = randn(72, dtype=torch.bfloat16, seed=6, scale=1.0)
    q, scale, new_res = rms_norm_fp8(x, w, EPS, res)
    normed, want_res = rms_norm(x, w, EPS, res)
    assert_bits_equal(q, quantize_rows(normed)[0])
    assert_bits_equal(new_res, want_res)
    empty = rms_norm_fp8(x[:0], w, EPS, res[:0])
    assert [tuple(t.shape) for t in empty] == [(0, 72), (0, 1), (0, 72)]


@pytest.mark.parametrize("case,match", [
    ("3d", r"x \[T, K\]"), ("int", "bf16, fp16 or fp32"), ("weight", "weight"),
    ("residual shape", "residual"), ("residual dtype", "residual"), ("wide", "at most"),
])
def test_rms_norm_fp8_refuses_bad_inputs(case, match):
    x, w = torch.zeros(2, 48, dtype=torch.bfloat16), torch.ones(48, dtype=torch.bfloat16)
    res = torch.zeros_like(x)
    if case == "3d":
        x = x.view(2, 3, 16)
    elif case == "int":
        x, res = x.to(torch.int32), res.to(torch.int32)
    elif case == "weight":
        w = torch.ones(47)
    elif case == "residual shape":
        res = res[:1]
    elif case == "residual dtype":
        res = res.float()
    else:
        x, w, res = torch.zeros(1, MAX_BLOCK + 16), torch.ones(MAX_BLOCK + 16), None
    with pytest.raises(ValueError, match=match):
        rms_norm_fp8(x.to(DEVICE), w.to(DEVICE), EPS, None if res is None else res.to(DEVICE))


# ---- SiLU-and-mul -> FP8 rows ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [24, 300, 1100])  # I: one BLOCK, masked tails
def test_silu_mul_fp8_is_silu_and_mul_then_quantize_rows(dtype, width):
    x = randn(5, 2 * width, dtype=dtype, seed=7)
    x[2] = 0
    x_before = x.clone()
    q, scale = silu_mul_fp8(x)
    assert q.dtype == FP8 and q.shape == (5, width) and scale.shape == (5, 1)
    assert torch.equal(x, x_before)
    want_q, want_scale = quantize_rows(silu_and_mul(x))
    assert_bits_equal(q, want_q)
    assert_bits_equal(scale, want_scale)
    q_ref, scale_ref = silu_mul_fp8_ref(x)
    assert_near_ref(q, scale, q_ref, scale_ref, dtype)
    assert scale[2].item() == scale_ref[2].item() and not q[2].float().any()


@pytest.mark.parametrize("case,match", [
    ("1d", r"\[T, 2I\]"), ("odd", r"\[T, 2I\]"), ("strided", "contiguous"),
    ("int", "bf16, fp16 or fp32"), ("wide", "at most"),
])
def test_silu_mul_fp8_refuses_bad_inputs(case, match):
    x = {"1d": torch.zeros(32), "odd": torch.zeros(2, 33),
         "strided": torch.zeros(32, 2).t(), "int": torch.zeros(2, 32, dtype=torch.int32),
         "wide": torch.zeros(1, 2 * MAX_BLOCK + 32)}[case]
    with pytest.raises(ValueError, match=match):
        silu_mul_fp8(x.to(DEVICE))
