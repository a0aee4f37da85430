"""The decode GEMVs with FP8 weights (kernels/gemv*.py with per-row scales) against their torch
references under Triton's interpreter, and an FP8 model's decode steps through the planned
GEMVs and fusions (engine/models/tp_layers.py `gemv_weight`) against the same model without."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from test_kernel_gemv import (  # noqa: E402
    _count_calls,
    _plan_everything,
    assert_close,
    interpreted,
    randn,
)

from engine.quant.fp8 import quantize_weight  # noqa: E402
from kernels.fp8 import FP8, w8a16_ref  # noqa: E402
from kernels.gemv import GemvBlocks, gemv, gemv_supports  # noqa: E402
from kernels.gemv_rmsnorm import gemv_rmsnorm, gemv_rmsnorm_ref  # noqa: E402
from kernels.gemv_rmsnorm_swiglu import (  # noqa: E402
    gemv_rmsnorm_swiglu,
    gemv_rmsnorm_swiglu_ref,
)
from kernels.gemv_silu import gemv_silu, gemv_silu_ref  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [n, k] and row scales [n] of a random weight whose rows differ in magnitude (so a
    scale applied to the wrong row shows)."""
    w = randn(n, k, dtype=torch.float32, seed=seed) * torch.linspace(0.1, 3.0, n)[:, None]
    q = quantize_weight(w)
    return q.qweight, q.scale


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_with_fp8_weight_matches_the_dequantized_reference(dtype, m):
    n, k = 37, 128
    x = randn(m, k, dtype=dtype, seed=m)
    q, s = fp8_weight(n, k, seed=4)
    b = randn(n, dtype=dtype, seed=5)
    for blocks in (GemvBlocks(4, 32, 4), GemvBlocks(8, 32, 4, kloop=True)):
        out = gemv(x, q, b, blocks, scale=s)
        assert_close(out, (w8a16_ref(x, q, s).float() + b.float()).to(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_silu_with_fp8_weight(dtype):
    n, inter = 21, 128
    gate_up = randn(2, 2 * inter, dtype=dtype, seed=1)
    q, s = fp8_weight(n, inter, seed=2)
    assert_close(gemv_silu(gate_up, q, GemvBlocks(4, 32, 4), scale=s),
                 gemv_silu_ref(gate_up, q, s))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_rmsnorm_and_swiglu_with_fp8_weight(dtype, with_residual):
    k, n, inter = 64, 23, 19
    x, res = randn(2, k, dtype=dtype, seed=1), randn(2, k, dtype=dtype, seed=2)
    res = res if with_residual else None
    nw = randn(k, dtype=dtype, seed=3)
    q, s = fp8_weight(n, k, seed=4)
    out, summed = gemv_rmsnorm(x, res, nw, 1e-5, q, None, GemvBlocks(4, k, 4), scale=s)
    ref_out, ref_s = gemv_rmsnorm_ref(x, res, nw, 1e-5, q, scale=s)
    assert_close(summed, ref_s)
    assert_close(out, ref_out)
    q2, s2 = fp8_weight(2 * inter, k, seed=6)
    for blocks in (GemvBlocks(4, k, 4), GemvBlocks(8, 32, 4)):  # one tile; the K loop
        act, _ = gemv_rmsnorm_swiglu(x, res, nw, 1e-5, q2, blocks, scale=s2)
        assert_close(act, gemv_rmsnorm_swiglu_ref(x, res, nw, 1e-5, q2, scale=s2)[0])


def test_fp8_weight_needs_its_row_scales():
    x, blocks = torch.zeros(1, 64), GemvBlocks(4, 32, 4)
    q, s = fp8_weight(8, 64, seed=1)
    assert gemv_supports(x, q, blocks, s)
    assert not gemv_supports(x, q, blocks)  # codes without scales
    assert not gemv_supports(x, q, blocks, s[:4])  # scales of another shape
    assert not gemv_supports(x, torch.zeros(8, 64), blocks, s)  # scales on a dense weight
    with pytest.raises(ValueError, match="fp8"):
        gemv(x, q, None, blocks)


@interpreted
@pytest.mark.parametrize(("swiglu", "k_step"), [(False, None), (True, None), (True, 16)],
                         ids=["silu+down", "norm+gate_up+silu", "norm+gate_up+silu-k-loop"])
def test_fp8_model_decode_steps_through_the_planned_gemvs(swiglu, k_step, monkeypatch):
    """An FP8 model (quantized on load, fp32 activations) with every decode fusion planned
    gives the logits of the same model without plans; the fused kernels ran on its codes."""
    from test_model_llama import CONFIGS, make_hf_model, make_paged_model, run_paged

    from engine.models import gemv_plan

    config = CONFIGS["llama-gqa-untied"]()
    hf_model = make_hf_model(config)
    config = copy.deepcopy(config)
    config.quantization_config = {"quant_method": "fp8"}
    monkeypatch.setattr(gemv_plan, "_DTYPES", (torch.float32,))  # plans are for CUDA tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    plain, planned = make_paged_model(config, hf_model), make_paged_model(config, hf_model)
    _plan_everything(planned, swiglu, k_step)
    monkeypatch.undo()
    qkv = planned.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == FP8 and qkv.qweight.gemv_norm_plan.used
    tokens = {"a": torch.randint(0, config.vocab_size, (12,),
                                 generator=torch.Generator().manual_seed(3))}
    steps = [[("a", 0, 9)], [("a", 9, 1)], [("a", 10, 1)], [("a", 11, 1)]]
    want = run_paged(plain, config, tokens, steps)
    calls = _count_calls(monkeypatch, ("gemv_silu", "gemv_rmsnorm", "gemv_rmsnorm_swiglu"))
    got = run_paged(planned, config, tokens, steps)
    torch.testing.assert_close(got["a"], want["a"], rtol=1e-4, atol=1e-4)
    steps = 3 * 2  # decode steps x layers
    if swiglu:  # norm + qkv, norm + gate_up + silu (o and down: the layer's own CPU path)
        assert calls == {"gemv_silu": 0, "gemv_rmsnorm": steps, "gemv_rmsnorm_swiglu": steps}
    else:  # norm + qkv, norm + gate_up, silu + down
        assert calls == {"gemv_silu": steps, "gemv_rmsnorm": 2 * steps, "gemv_rmsnorm_swiglu": 0}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2, 4])
def test_fp8_gemvs_gpu_full_size(m):
    """The 1B shapes on the GPU (its fp8 conversion, not the interpreter's), every kernel and
    the tiles the FP8 plan may choose."""
    from engine.models.gemv_plan import FP8_CANDIDATES, _with_fp8_tiles

    def weight(n, k, seed):
        q, s = fp8_weight(n, k, seed)
        return q.cuda(), s.cuda()

    x, res = (randn(m, 2048, dtype=torch.bfloat16, seed=s, device="cuda") for s in (m, 7 + m))
    for (n, k), seed in (((3072, 2048), 1), ((128256, 2048), 2), ((2048, 8192), 6)):
        q, s = weight(n, k, seed)
        xk = x if k == 2048 else randn(m, k, dtype=torch.bfloat16, seed=m, device="cuda")
        tiles = [b for b in (GemvBlocks(4, 512, 4), *FP8_CANDIDATES["linear"].get(m, ()))
                 if gemv_supports(xk, q, b, s)]  # a BLOCK_K dividing K
        assert len(tiles) > 1
        for blocks in tiles:
            out = gemv(xk, q, None, blocks, scale=s)
            assert _rel_err(out, w8a16_ref(xk, q, s)) < 4e-3, blocks
    q, s = weight(2048, 8192, 3)
    gate_up = randn(m, 2 * 8192, dtype=torch.bfloat16, seed=m, device="cuda")
    for blocks in (GemvBlocks(4, 512, 4), *FP8_CANDIDATES["silu+down"].get(m, ())):
        out = gemv_silu(gate_up, q, blocks, scale=s)
        assert _rel_err(out, gemv_silu_ref(gate_up, q, s)) < 4e-3, blocks
    if m > 2:
        return
    nw = randn(2048, dtype=torch.bfloat16, seed=4, device="cuda")
    q, s = weight(16384, 2048, 5)
    for blocks in _with_fp8_tiles("norm+linear", 2048, {})[1]:
        out, summed = gemv_rmsnorm(x, res, nw, 1e-5, q, None, blocks, scale=s)
        ref_out, ref_s = gemv_rmsnorm_ref(x, res, nw, 1e-5, q, scale=s)
        assert torch.equal(summed, ref_s) and _rel_err(out, ref_out) < 4e-3
    for blocks in _with_fp8_tiles("norm+gate_up+silu", 2048, {})[1]:  # the K loop's too
        act, _ = gemv_rmsnorm_swiglu(x, res, nw, 1e-5, q, blocks, scale=s)
        ref_act = gemv_rmsnorm_swiglu_ref(x, res, nw, 1e-5, q, scale=s)[0]
        assert _rel_err(act, ref_act) < 1e-2, blocks
