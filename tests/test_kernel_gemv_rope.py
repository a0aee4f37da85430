"""The attention's norm, q/k/v projection, rotary and K/V store in one GEMV
(kernels/gemv_rmsnorm_rope.py) against gemv_rmsnorm then rope_and_store, under Triton's
interpreter; and a model's decode steps through it (engine/models/fused_qkv_rope.py) against
the same model without it."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from engine.models.gemv_plan import GemvPlan  # noqa: E402
from kernels.gemv import GemvBlocks  # noqa: E402
from kernels.gemv_rmsnorm_rope import gemv_rmsnorm_rope, gemv_rmsnorm_rope_ref  # noqa: E402
from kernels.rotary import cos_sin_cache  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors: needs TRITON_INTERPRET=1")
HQ, HKV, D, K = 4, 2, 16, 32  # heads, kv heads, head_dim, hidden
N = (HQ + 2 * HKV) * D


def _operands(dtype, m, seed, fp8_cache=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    cache_dtype = torch.float8_e4m3fn if fp8_cache else dtype
    caches = [torch.zeros(4, 4, HKV, D).to(cache_dtype) for _ in range(2)]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    return dict(
        x=rand(m, K), residual=rand(m, K), norm_weight=rand(K, scale=0.5) + 1, eps=1e-5,
        weight=rand(N, K, scale=0.2), bias=rand(N, scale=0.1),
        positions=torch.tensor([3, 9, 14, 1][:m], dtype=torch.int64),
        slot_mapping=torch.tensor([5, -1, 12, 0][:m], dtype=torch.int64),  # -1: padding
        cos_sin=cos_sin_cache(inv_freq, 16, torch.device("cpu")), caches=caches)


def _run(fn, ops, blocks=None, scale=None, **kv):
    k_cache, v_cache = (c.clone() for c in ops["caches"])
    args = (ops["x"], ops["residual"], ops["norm_weight"], ops["eps"], ops["weight"], ops["bias"])
    common = dict(num_heads=HQ, num_kv_heads=HKV, positions=ops["positions"],
                  cos_sin=ops["cos_sin"], k_cache=k_cache, v_cache=v_cache,
                  slot_mapping=ops["slot_mapping"], **kv)
    if fn is gemv_rmsnorm_rope:
        qkv, s = fn(*args, blocks, scale, **common)
    else:
        qkv, s = fn(*args, scale, **common)
    return qkv, s, k_cache, v_cache


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_fused_qkv_rope_store_matches_the_two_kernels(dtype, m):
    """q rotated in the output, k rotated and v into the cache at each row's slot (none for a
    padding row's -1), the residual sum: as the norm + projection and then rope_and_store."""
    ops = _operands(dtype, m, seed=m)
    got = _run(gemv_rmsnorm_rope, ops, GemvBlocks(4, K, 4))
    want = _run(gemv_rmsnorm_rope_ref, ops)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)
    for cache in got[2:]:  # only the rows' own slots hold values (a padding row's: none)
        written = (cache.flatten(0, 1).float().abs().sum((1, 2)) > 0).nonzero().flatten()
        assert written.tolist() == sorted(s for s in ops["slot_mapping"].tolist() if s >= 0)


@interpreted
def test_fused_qkv_rope_store_into_an_fp8_cache_with_an_fp8_weight():
    """FP8 codes with row scales, and an fp8 cache with its scales: the same codes stored as
    the unfused kernels store."""
    from engine.quant.fp8 import quantize_weight

    ops = _operands(torch.float32, 2, seed=7, fp8_cache=True)
    q = quantize_weight(ops["weight"])
    ops["weight"] = q.qweight
    got = _run(gemv_rmsnorm_rope, ops, GemvBlocks(2, K, 4), q.scale, k_scale=0.05, v_scale=0.02)
    want = _run(gemv_rmsnorm_rope_ref, ops, None, q.scale, k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[2:], want[2:], strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_fused_qkv_rope_refuses_a_weight_that_is_not_q_k_v_heads():
    ops = _operands(torch.float32, 1, seed=1)
    with pytest.raises(ValueError, match="q \\+ 2 kv heads"):
        gemv_rmsnorm_rope(ops["x"], None, ops["norm_weight"], 1e-5, ops["weight"][:-D], None,
                          None, None, num_heads=HQ, num_kv_heads=HKV,
                          positions=ops["positions"], cos_sin=ops["cos_sin"],
                          k_cache=ops["caches"][0], v_cache=ops["caches"][1],
                          slot_mapping=ops["slot_mapping"])


@interpreted
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied"])
def test_model_decode_steps_through_the_fused_qkv_rope(name, monkeypatch):
    """A model on the Triton backend with norm + q/k/v planned: its decode steps take the fused
    kernel (rope_and_store only for the prompt's step) and give the logits of the plain path."""
    import test_model_llama as helpers

    import engine.attention.triton_backend as backend_module
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.models import fused_qkv_rope, gemv_plan, get_model_class

    config = helpers.CONFIGS[name]()
    hf_model = helpers.make_hf_model(config)

    def paged():
        model = get_model_class(config)(config, TritonAttentionBackend(num_sms=4)).eval()
        model.load_weights(hf_model.state_dict().items())
        return model

    plain, planned = paged(), paged()
    monkeypatch.setattr(gemv_plan, "_DTYPES", (torch.float32,))  # plans are for CUDA tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for (_, k), pairs in gemv_plan._normed_weights(planned).items():
        for w, _ in pairs:
            w.gemv_norm_plan = GemvPlan(((1, GemvBlocks(4, k, 4)),))
    monkeypatch.undo()
    tokens = {"a": torch.randint(0, config.vocab_size, (12,),
                                 generator=torch.Generator().manual_seed(3))}
    steps = [[("a", 0, 9)], [("a", 9, 1)], [("a", 10, 1)], [("a", 11, 1)]]
    want = helpers.run_paged(plain, config, tokens, steps)
    calls = {"fused": 0, "rope_and_store": 0}
    real_fused, real_rope = fused_qkv_rope.gemv_rmsnorm_rope, backend_module.rope_and_store
    monkeypatch.setattr(fused_qkv_rope, "gemv_rmsnorm_rope",
                        lambda *a, **kw: calls.__setitem__("fused", calls["fused"] + 1)
                        or real_fused(*a, **kw))
    monkeypatch.setattr(backend_module, "rope_and_store",
                        lambda *a: calls.__setitem__("rope_and_store",
                                                     calls["rope_and_store"] + 1) or real_rope(*a))
    got = helpers.run_paged(planned, config, tokens, steps)
    torch.testing.assert_close(got["a"], want["a"], rtol=1e-4, atol=1e-4)
    layers = config.num_hidden_layers
    assert calls == {"fused": 3 * layers, "rope_and_store": layers}  # 3 decodes, 1 prompt step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_fused_qkv_rope_gpu_full_size(m, fp8):
    """The 1B shape on the GPU (32 / 8 heads of 64, hidden 2048, bf16; FP8 codes too) against
    the two kernels it replaces, run on the GPU as well."""
    from engine.quant.fp8 import quantize_weight
    from kernels.gemv_rmsnorm import gemv_rmsnorm
    from kernels.rope_store import rope_and_store

    gen = torch.Generator().manual_seed(m)
    hq, hkv, d, k = 32, 8, 64, 2048
    n = (hq + 2 * hkv) * d

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).cuda()

    x, residual, nw = rand(m, k), rand(m, k), rand(k, scale=0.1) + 1
    weight, scale = rand(n, k, scale=0.02), None
    if fp8:
        q = quantize_weight(weight.float())
        weight, scale = q.qweight, q.scale
    inv_freq = 1.0 / 500000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    cos_sin = cos_sin_cache(inv_freq, 4096, torch.device("cuda"))
    positions = torch.tensor([7, 1000, 4000, 33][:m], device="cuda")
    slots = torch.tensor([17, 900, -1, 3000][:m], device="cuda")
    caches = [torch.zeros(256, 16, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    kw = dict(num_heads=hq, num_kv_heads=hkv, positions=positions, cos_sin=cos_sin,
              slot_mapping=slots)
    for blocks in (GemvBlocks(8, k, 8, pdl=True), GemvBlocks(16, k, 8)):
        got, s_got = gemv_rmsnorm_rope(x, residual, nw, 1e-5, weight, None, blocks, scale,
                                       k_cache=caches[0], v_cache=caches[1], **kw)
        want, s_want = gemv_rmsnorm(x, residual, nw, 1e-5, weight, None, blocks, scale)
        rope_and_store(positions, want[:, :hq * d].view(m, hq, d),
                       want[:, hq * d:(hq + hkv) * d].view(m, hkv, d),
                       want[:, (hq + hkv) * d:].view(m, hkv, d), caches[2], caches[3], slots,
                       cos_sin)
        torch.cuda.synchronize()
        assert torch.equal(s_got, s_want)
        for g, w in ((got, want), (caches[0], caches[2]), (caches[1], caches[3])):
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
