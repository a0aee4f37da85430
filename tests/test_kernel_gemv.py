"""The decode GEMVs (kernels/gemv.py, kernels/gemv_silu.py) against their torch references: on
the CPU through Triton's interpreter at small shapes, on a GPU at the 1B model's shapes; and
the dense-linear path that uses them (engine/models/tp_layers.py) with and without a plan."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from engine.distributed.group import SingleRank  # noqa: E402
from engine.models.gemv_plan import GemvPlan  # noqa: E402
from engine.models.tp_layers import (  # noqa: E402
    Linear,
    RowParallelLinear,
    dense_linear,
    silu_mul_linear,  # noqa: E402
)
from kernels.gemv import GemvBlocks, gemv, gemv_ref, gemv_supports  # noqa: E402
from kernels.gemv_rmsnorm import gemv_rmsnorm, gemv_rmsnorm_ref  # noqa: E402
from kernels.gemv_rmsnorm_swiglu import (  # noqa: E402
    gemv_rmsnorm_swiglu,
    gemv_rmsnorm_swiglu_ref,
)
from kernels.gemv_silu import gemv_silu, gemv_silu_ref  # noqa: E402
from kernels.silu_mul import silu_and_mul_ref  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# the small-shape tests hand CPU tensors to the kernels: Triton's interpreter only (on a GPU the
# kernels compile for it and the *_gpu_full_size tests below check them)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors: needs TRITON_INTERPRET=1")


def randn(*shape, dtype, seed, device="cpu", scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: the same sums in another order; 16-bit: both rounded once from fp32 sums (one or
    two ulps apart: the interpreter truncates when it casts, a GPU rounds to nearest)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any()
    scale = ref.float().abs().max().item()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale)
    else:
        eps = torch.finfo(out.dtype).eps
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=2 * eps * scale)


# ---- CPU, under TRITON_INTERPRET=1 (conftest sets it without a GPU) --------------------------
@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("blocks", [GemvBlocks(4, 32, 4), GemvBlocks(16, 64, 4),
                                    GemvBlocks(8, 32, 4, kloop=True)], ids=str)
def test_gemv_matches_reference(dtype, m, blocks):
    n, k = 37, 128  # N odd (the last program's rows clamp), K two and four blocks
    x, w = randn(m, k, dtype=dtype, seed=m), randn(n, k, dtype=dtype, seed=10 + m)
    assert_close(gemv(x, w, None, blocks), gemv_ref(x, w))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_bias_and_strided_rows(dtype):
    n, k = 19, 64
    x_wide = randn(3, 2 * k, dtype=dtype, seed=1)
    x = x_wide[:, :k]  # rows strided, columns contiguous
    w, b = randn(n, k, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    assert_close(gemv(x, w, b, GemvBlocks(4, 32, 4)), gemv_ref(x, w, b))
    assert_close(gemv(x, w, b, GemvBlocks(4, 32, 4, kloop=True)), gemv_ref(x, w, b))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_gemv_silu_matches_reference(dtype, m):
    n, inter = 21, 128
    gate_up, w = randn(m, 2 * inter, dtype=dtype, seed=m), randn(n, inter, dtype=dtype, seed=7)
    out = gemv_silu(gate_up, w, GemvBlocks(4, 32, 4))
    assert_close(out, gemv_silu_ref(gate_up, w))
    # the same as the two kernels it replaces: silu_and_mul, then the GEMV
    assert_close(out, gemv_ref(silu_and_mul_ref(gate_up), w))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_rmsnorm_matches_reference(dtype, m, with_residual):
    n, k = 23, 64
    x, res = randn(m, k, dtype=dtype, seed=m), randn(m, k, dtype=dtype, seed=20 + m)
    res = res if with_residual else None
    nw, w = randn(k, dtype=dtype, seed=5), randn(n, k, dtype=dtype, seed=6)
    b = randn(n, dtype=dtype, seed=7)
    out, s = gemv_rmsnorm(x, res, nw, 1e-5, w, b, GemvBlocks(4, k, 4))
    ref_out, ref_s = gemv_rmsnorm_ref(x, res, nw, 1e-5, w, b)
    assert_close(s, ref_s)
    assert_close(out, ref_out)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("block_k", [64, 16], ids=["one-tile", "k-loop"])
def test_gemv_rmsnorm_swiglu_matches_reference(dtype, m, with_residual, block_k):
    inter, k = 19, 64  # I odd: the last program's rows clamp
    x, res = randn(m, k, dtype=dtype, seed=m), randn(m, k, dtype=dtype, seed=30 + m)
    res = res if with_residual else None
    nw, w = randn(k, dtype=dtype, seed=8), randn(2 * inter, k, dtype=dtype, seed=9)
    out, s = gemv_rmsnorm_swiglu(x, res, nw, 1e-5, w, GemvBlocks(4, block_k, 4))
    ref_out, ref_s = gemv_rmsnorm_swiglu_ref(x, res, nw, 1e-5, w)
    assert_close(s, ref_s)
    assert_close(out, ref_out)


@interpreted
def test_gemv_rmsnorm_swiglu_refuses_a_k_step_that_is_no_power_of_two():
    x, nw, w = torch.zeros(1, 64), torch.ones(64), torch.zeros(8, 64)
    for block_k in (24, 8):
        with pytest.raises(ValueError, match="BLOCK_K"):
            gemv_rmsnorm_swiglu(x, None, nw, 1e-5, w, GemvBlocks(4, block_k, 4))


@interpreted
def test_gemv_refuses_what_it_cannot_take():
    w = torch.zeros(8, 96)
    blocks = GemvBlocks(4, 64, 4)
    assert not gemv_supports(torch.zeros(1, 96), w, blocks)  # K not a multiple of BLOCK_K
    assert not gemv_supports(torch.zeros(5, 128), torch.zeros(8, 128), blocks)  # M > 4
    assert not gemv_supports(torch.zeros(1, 128).t(), torch.zeros(8, 128), blocks)
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.zeros(1, 96), w, None, blocks)


def test_plan_picks_per_token_count():
    b1, b4 = GemvBlocks(4, 512, 4), GemvBlocks(8, 256, 8)
    plan = GemvPlan(((1, b1), (2, None), (4, b4)))
    assert [plan.blocks_for(m) for m in (1, 2, 3, 4, 5)] == [b1, None, b4, b4, None]
    assert plan.used and not GemvPlan(((1, None),)).used


@interpreted
def test_dense_linear_without_a_plan_is_f_linear_and_with_one_is_the_gemv():
    """CPU behaviour is unchanged (no plan is made off CUDA); a plan, where given, routes
    decode-sized inputs to the GEMV and larger ones to F.linear."""
    layer = Linear(64, 24, bias=True)
    x1, x8 = randn(1, 64, dtype=torch.float32, seed=1), randn(8, 64, dtype=torch.float32, seed=2)
    want1 = torch.nn.functional.linear(x1, layer.weight, layer.bias)
    assert torch.equal(layer(x1), want1)
    layer.weight.gemv_plan = GemvPlan(((1, GemvBlocks(4, 32, 4)), (2, None), (4, None)))
    with torch.no_grad():
        assert_close(layer(x1), gemv_ref(x1, layer.weight, layer.bias))
        assert torch.equal(dense_linear(x8, layer.weight, layer.bias),
                           torch.nn.functional.linear(x8, layer.weight, layer.bias))


@interpreted
def test_silu_mul_linear_only_where_planned():
    down = RowParallelLinear(64, 16, range(64), bias=False, tp=SingleRank())
    torch.nn.init.normal_(down.weight)
    gate_up = randn(2, 128, dtype=torch.float32, seed=3)
    assert silu_mul_linear(gate_up, down) is None
    down.weight.gemv_silu_plan = GemvPlan(((1, None), (2, GemvBlocks(4, 32, 4)), (4, None)))
    with torch.no_grad():
        assert_close(silu_mul_linear(gate_up, down), gemv_silu_ref(gate_up, down.weight))
        assert silu_mul_linear(gate_up[:1], down) is None  # M = 1: cuBLAS was chosen


def _plan_everything(model: torch.nn.Module, swiglu: bool, gated_k_step: int | None = None
                     ) -> None:
    """Plans as the load would make them on CUDA, every fusion on at M = 1 (tiles for K 64 /
    128), none above; with `swiglu`, norm + gate_up + SwiGLU in one GEMV too (its K-loop
    kernel, steps of `gated_k_step`, when given)."""
    from engine.models.gemv_plan import (
        _dense_weights,
        _down_weights,
        _gated_weights,
        _normed_weights,
    )

    def one(blocks):
        return GemvPlan(((1, blocks), (2, None), (4, None)))

    for weights in _dense_weights(model).values():
        for w in weights:
            w.gemv_plan = one(GemvBlocks(4, 32, 4))
    for weights in _down_weights(model).values():
        for w in weights:
            w.gemv_silu_plan = one(GemvBlocks(2, 32, 4))
    for (_, k), pairs in _normed_weights(model).items():
        for w, _ in pairs:
            w.gemv_norm_plan = GemvPlan(((1, GemvBlocks(4, k, 4)),))
    for (_, k), pairs in _gated_weights(model).items() if swiglu else ():
        for w, _ in pairs:
            w.gemv_norm_silu_plan = GemvPlan(((1, GemvBlocks(2, gated_k_step or k, 4)),))


@interpreted
@pytest.mark.parametrize("swiglu", [False, True], ids=["silu+down", "norm+gate_up+silu"])
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied"])
def test_model_decode_steps_with_every_fusion_match_without(name, swiglu, monkeypatch):
    """The model's decode steps through the planned GEMVs (norm + q/k/v, o, norm + gate_up,
    silu + down, lm_head; or norm + gate_up + silu, then down) give the logits of the plain
    path; the prompt step (9 tokens) takes the plain path either way."""
    from test_model_llama import CONFIGS, make_hf_model, make_paged_model, run_paged

    from engine.models import gemv_plan

    monkeypatch.setattr(gemv_plan, "_DTYPES", (torch.float32,))  # plans are for CUDA tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    config = CONFIGS[name]()
    hf_model = make_hf_model(config)
    plain, planned = make_paged_model(config, hf_model), make_paged_model(config, hf_model)
    _plan_everything(planned, swiglu)
    monkeypatch.undo()
    assert planned.model.layers[0].self_attn.qkv_proj.weight.gemv_norm_plan.used
    tokens = {"a": torch.randint(0, config.vocab_size, (12,),
                                 generator=torch.Generator().manual_seed(3))}
    steps = [[("a", 0, 9)], [("a", 9, 1)], [("a", 10, 1)], [("a", 11, 1)]]
    want = run_paged(plain, config, tokens, steps)
    calls = _count_calls(monkeypatch,
                         ("gemv", "gemv_silu", "gemv_rmsnorm", "gemv_rmsnorm_swiglu"))
    got = run_paged(planned, config, tokens, steps)
    torch.testing.assert_close(got["a"], want["a"], rtol=1e-4, atol=1e-4)
    steps = 3 * 2  # decode steps x layers; and each decode step's lm_head
    if swiglu:  # norm + qkv, o, norm + gate_up + silu, down
        want_calls = {"gemv": 2 * steps + 3, "gemv_silu": 0, "gemv_rmsnorm": steps,
                      "gemv_rmsnorm_swiglu": steps}
    else:  # norm + qkv, o, norm + gate_up, silu + down
        want_calls = {"gemv": steps + 3, "gemv_silu": steps, "gemv_rmsnorm": 2 * steps,
                      "gemv_rmsnorm_swiglu": 0}
    assert calls == want_calls


def _count_calls(monkeypatch, names):
    from engine.models import tp_layers

    calls = dict.fromkeys(names, 0)
    def counting(name):
        fn = getattr(tp_layers, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name in names:
        monkeypatch.setattr(tp_layers, name, counting(name))
    return calls


# ---- GPU, full size ----------------------------------------------------------------------------
@gpu_only
def test_pdl_chain_in_a_cuda_graph_reads_what_the_kernel_ahead_wrote():
    """Programmatic dependent launches in a captured graph, each GEMV's input the output of the
    one before: every step must see its predecessor's finished result."""
    k = 2048
    ws = [randn(k, k, dtype=torch.bfloat16, seed=40 + i, device="cuda", scale=0.03)
          for i in range(8)]
    x = randn(1, k, dtype=torch.bfloat16, seed=50, device="cuda")
    pdl, plain = GemvBlocks(2, 1024, 4, pdl=True), GemvBlocks(2, 1024, 4)

    def chain(blocks):
        y = x
        for w in ws:
            y = gemv(y, w, None, blocks)
        return y

    want = chain(plain)
    chain(pdl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(pdl)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)

SHAPES_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]


def _poisoned_empty(m: int, n: int, dtype: torch.dtype) -> None:
    """Leave NaNs in the allocator's next block of this size: an unwritten output shows."""
    torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@gpu_only
@pytest.mark.parametrize("shape", SHAPES_1B, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_gpu_full_size(shape, m):
    n, k = shape
    x = randn(m, k, dtype=torch.bfloat16, seed=m, device="cuda")
    w = randn(n, k, dtype=torch.bfloat16, seed=n + m, device="cuda", scale=0.02)
    for blocks in (GemvBlocks(4, 512, 4), GemvBlocks(8, 256, 8), GemvBlocks(2, 1024, 4),
                   GemvBlocks(4, 1024, 4, pdl=True)):
        _poisoned_empty(m, n, torch.bfloat16)
        out = gemv(x, w, None, blocks)
        ref = gemv_ref(x, w)
        assert not out.isnan().any()
        assert _rel_err(out, ref) < 4e-3  # bf16 output rounding (~2e-3 relative)
        assert _rel_err(out, torch.nn.functional.linear(x, w)) < 6e-3


@gpu_only
@pytest.mark.parametrize("shape", [(3072, 2048), (16384, 2048)], ids=str)
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_rmsnorm_gpu_full_size(shape, m):
    n, k = shape
    x, res = (randn(m, k, dtype=torch.bfloat16, seed=s, device="cuda") for s in (m, 9 + m))
    nw = randn(k, dtype=torch.bfloat16, seed=3, device="cuda")
    w = randn(n, k, dtype=torch.bfloat16, seed=4, device="cuda", scale=0.02)
    for blocks in (GemvBlocks(2, k, 4), GemvBlocks(4, k, 4), GemvBlocks(8, k, 8),
                   GemvBlocks(4, k, 8, pdl=True)):
        _poisoned_empty(m, n, torch.bfloat16)
        out, s = gemv_rmsnorm(x, res, nw, 1e-5, w, None, blocks)
        ref_out, ref_s = gemv_rmsnorm_ref(x, res, nw, 1e-5, w)
        assert torch.equal(s, ref_s)
        assert not out.isnan().any()
        assert _rel_err(out, ref_out) < 4e-3


@gpu_only
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_rmsnorm_swiglu_gpu_full_size(m):
    x, res = (randn(m, 2048, dtype=torch.bfloat16, seed=s, device="cuda") for s in (m, 5 + m))
    nw = randn(2048, dtype=torch.bfloat16, seed=3, device="cuda")
    w = randn(16384, 2048, dtype=torch.bfloat16, seed=4, device="cuda", scale=0.02)
    for blocks in (GemvBlocks(1, 2048, 4), GemvBlocks(2, 2048, 4), GemvBlocks(4, 2048, 8),
                   GemvBlocks(2, 2048, 8, pdl=True), GemvBlocks(16, 256, 4),
                   GemvBlocks(8, 512, 4, pdl=True)):
        _poisoned_empty(m, 8192, torch.bfloat16)
        out, s = gemv_rmsnorm_swiglu(x, res, nw, 1e-5, w, blocks)
        ref_out, ref_s = gemv_rmsnorm_swiglu_ref(x, res, nw, 1e-5, w)
        assert torch.equal(s, ref_s)
        assert not out.isnan().any()
        assert _rel_err(out, ref_out) < 1e-2  # g and u each rounded to bf16 before the product


@gpu_only
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_silu_gpu_full_size(m):
    gate_up = randn(m, 2 * 8192, dtype=torch.bfloat16, seed=m, device="cuda")
    w = randn(2048, 8192, dtype=torch.bfloat16, seed=5, device="cuda", scale=0.02)
    for blocks in (GemvBlocks(4, 512, 4), GemvBlocks(8, 256, 8), GemvBlocks(4, 2048, 8, True)):
        _poisoned_empty(m, 2048, torch.bfloat16)
        out = gemv_silu(gate_up, w, blocks)
        assert not out.isnan().any()
        assert _rel_err(out, gemv_silu_ref(gate_up, w)) < 4e-3
