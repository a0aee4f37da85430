"""The W4A16 GEMV with its activations computed in the prologue (kernels/w4a16_gemv.py
`w4a16_gemv_rmsnorm`, `w4a16_gemv_swiglu`; kernels/gemv_inputs.py): in fp32 the references of
the unfused ops, in bf16 the unfused kernels (Triton interpreter on the CPU, tiny shapes); the
layer's hooks on CUDA; bad operands named."""

from __future__ import annotations

import pytest
import torch
from hopper_compile import compile_for_hopper
from quant_helpers import random_w4a16_layout, rel_err

import kernels.w4a16_gemv as gemv_module
from kernels.rmsnorm import rms_norm, rms_norm_ref
from kernels.silu_mul import silu_and_mul, silu_and_mul_ref
from kernels.w4a16 import w4a16_ref
from kernels.w4a16_gemv import w4a16_gemv, w4a16_gemv_rmsnorm, w4a16_gemv_swiglu

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-5


def _operands(m: int, k: int, n: int, group: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(m, k, generator=gen).to(dtype) for _ in range(2))
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    layout = random_w4a16_layout(k, n, group, seed)
    return [t.to(DEVICE) for t in (x, residual, norm_w)], [t.to(DEVICE) for t in layout]


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("split_k", [1, 2])
def test_rmsnorm_prologue_is_the_norm_then_the_gemv_in_fp32(monkeypatch, with_residual: bool,
                                                            split_k: int) -> None:
    """K = 96 read in 64-wide prologue steps (a ragged last step would show), two groups a
    step (max ROWS 8) and K shares."""
    monkeypatch.setattr(gemv_module, "PROLOGUE_BLOCK", 64)
    (x, residual, norm_w), layout = _operands(2, 96, 40, 32, torch.float32, seed=1)
    res = residual if with_residual else None
    y, s = w4a16_gemv_rmsnorm(x, res, norm_w, EPS, *layout, 32, (16, 8, 1), split_k)
    normed, want_s = (rms_norm_ref(x, norm_w, EPS, residual) if with_residual
                      else (rms_norm_ref(x, norm_w, EPS), x))
    assert torch.equal(s, want_s)
    assert rel_err(y.cpu(), w4a16_ref(normed.cpu(), *[t.cpu() for t in layout], 32)) < 1e-5


@pytest.mark.parametrize("split_k", [1, 3])
def test_swiglu_prologue_is_silu_mul_then_the_gemv_in_fp32(split_k: int) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(2, 192, generator=gen) * 2).to(DEVICE)  # K = 96
    layout = [t.to(DEVICE) for t in random_w4a16_layout(96, 24, 32, seed=2)]
    y = w4a16_gemv_swiglu(gate_up, *layout, 32, (16, 2, 1), split_k)
    want = w4a16_ref(silu_and_mul_ref(gate_up).cpu(), *[t.cpu() for t in layout], 32)
    assert rel_err(y.cpu(), want) < 1e-5


def test_bf16_prologues_round_as_the_unfused_kernels() -> None:
    """bf16: the same roundings as kernels/rmsnorm.py and kernels/silu_mul.py followed by the
    plain GEMV (the new residual stream bit for bit)."""
    (x, residual, norm_w), layout = _operands(1, 128, 48, 64, torch.bfloat16, seed=3)
    y, s = w4a16_gemv_rmsnorm(x, residual, norm_w, EPS, *layout, 64, (16, 4, 1))
    normed, want_s = rms_norm(x, norm_w, EPS, residual)
    assert torch.equal(s, want_s)
    assert rel_err(y, w4a16_gemv(normed, *layout, 64, (16, 4, 1))) < 1e-2
    gate_up = torch.cat([x, residual], dim=1) * 2  # K = 128
    layout = [t.to(DEVICE) for t in random_w4a16_layout(128, 32, 64, seed=4)]
    y = w4a16_gemv_swiglu(gate_up, *layout, 64, (16, 4, 1))
    assert rel_err(y, w4a16_gemv(silu_and_mul(gate_up), *layout, 64, (16, 4, 1))) < 1e-2


def test_bad_operands_are_named() -> None:
    (x, residual, norm_w), layout = _operands(1, 64, 16, 32, torch.float32, seed=5)
    with pytest.raises(ValueError, match="norm weight"):
        w4a16_gemv_rmsnorm(x, residual, norm_w[:32], EPS, *layout, 32)
    with pytest.raises(ValueError, match="residual"):
        w4a16_gemv_rmsnorm(x, residual.double(), norm_w, EPS, *layout, 32)
    with pytest.raises(ValueError, match="gate_up"):
        w4a16_gemv_swiglu(x[:, :63], *layout, 32)
    with pytest.raises(ValueError, match="qweight"):  # gate_up's halves must be W's K
        w4a16_gemv_swiglu(torch.cat([x, x, x, x], 1), *layout, 32)


@pytest.mark.skipif(not CUDA, reason="the layer's fused hooks run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_hooks_equal_the_unfused_layer_on_the_gpu(monkeypatch, dtype: torch.dtype) -> None:
    """W4A16Linear.rmsnorm_linear and silu_mul_linear (what the model's decode step calls, with
    `prologues` on) against the norm or SwiGLU kernel and then the layer, at the 1B shapes' K;
    off, they decline."""
    from engine.models.layers import RMSNorm
    from engine.quant.w4a16 import dequantize
    from engine.quant.w4a16_linear import W4A16Linear
    from engine.quant.w4a16_quantize import quantize

    monkeypatch.setattr(W4A16Linear, "prologues", True)
    gen = torch.Generator().manual_seed(6)
    for k, n in ((2048, 3072), (8192, 2048)):
        w = quantize(torch.randn(n, k, generator=gen) * 0.05, 128)
        layer = W4A16Linear(k, n, bias=False).to(device="cuda", dtype=dtype)
        layer.weight.weight_loader(layer.weight, slice(None), w, "w")
        norm = RMSNorm(k, EPS).to(device="cuda", dtype=dtype)
        norm.weight.data = (torch.rand(k, generator=gen) + 0.5).to("cuda", dtype)
        x, residual = (torch.randn(1, k, generator=gen).to("cuda", dtype) for _ in range(2))
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        y, s = layer.rmsnorm_linear(x, residual, norm)
        normed, want_s = rms_norm(x, norm.weight, EPS, residual)
        assert torch.equal(s, want_s)
        assert rel_err(y, layer(normed)) < tol
        exact = dequantize(w).cuda()
        assert rel_err(y, normed.float() @ exact.t()) < max(tol, 1e-2 if dtype != torch.float32
                                                             else 1e-4)
        gate_up = torch.randn(1, 2 * k, generator=gen).to("cuda", dtype)
        assert rel_err(layer.silu_mul_linear(gate_up), layer(silu_and_mul(gate_up))) < tol
        assert layer.rmsnorm_linear(torch.cat([x, x]), None, norm) is None  # two tokens
        monkeypatch.setattr(W4A16Linear, "prologues", False)
        assert layer.rmsnorm_linear(x, residual, norm) is None
        assert layer.silu_mul_linear(gate_up) is None
        monkeypatch.setattr(W4A16Linear, "prologues", True)



_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
import kernels.gemv_inputs as inputs
from pdserve.bench.sass_loop import gemv_source

for form in ("PLAIN", "NORM", "NORM_RESIDUAL", "SWIGLU", "PLAIN_TMA"):
    tma = form.endswith("_TMA")
    consts = dict(BLOCK_N=64, ROWS=16, GROUP_ROWS=16, SPLIT_K=2,
                  FORM=getattr(inputs, form.removesuffix("_TMA")).value, PRO_BLOCK=1024,
                  PREFETCH=form not in ("PLAIN", "PLAIN_TMA"), LINES=2, PAIRS=form != "NORM",
                  PAIRS_ASM=True, EVEN_N=form == "SWIGLU", STAGES=3 if tma else 1, TMA=tma)
    ptx = triton.compile(gemv_source(consts, divisible=False), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    print(form, ptx.count("cp.async.bulk.tensor" if tma else "ld.global"))
"""


def test_every_form_compiles_for_hopper() -> None:
    """The interpreter runs what the compiler refuses (a global that is not a constexpr, say):
    each form, and the codes by TMA descriptor, compiled for sm_90 by Triton's own ptxas, no
    GPU needed (a process without TRITON_INTERPRET)."""
    loads = compile_for_hopper(_COMPILE_FOR_HOPPER)
    assert list(loads) == ["PLAIN", "NORM", "NORM_RESIDUAL", "SWIGLU", "PLAIN_TMA"]
    assert all(int(loads[form]) > int(loads["PLAIN"]) for form in list(loads)[1:4])  # prologues
    assert int(loads["PLAIN_TMA"]) > 0  # the codes' tiles by TMA (cp.async.bulk.tensor)
