"""kernels/cpu_attention: a CPU decode step's rotary, K/V store and paged attention in one C call,
against its torch reference (fp32 and bf16, with and without rotary, GQA groups of 1 to 4, head
sizes 64 / 128 and one the kernel does not specialise, the split-K path of few tasks, shuffled
tables, lengths straddling block edges); out-of-range slots and block ids raised; what it does
not take refused; TorchAttentionBackend taking it for steps of decodes only and giving what its
torch ops give."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import SeqChunk, build_metadata, shuffled_block_tables

from engine.attention import torch_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.rotary import RopeInputs, RotaryEmbedding
from kernels import cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler here")
BS = 16


def _decodes(lens: list[int], heads: int, kv_heads: int, d: int, dtype: torch.dtype,
             seed: int, rope: bool = True):
    """A decode step: q/k/v as views of one fused qkv row a token, a cache holding random
    earlier context, shuffled tables, each decode's slot at its last position."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in lens) + 3
    tables = shuffled_block_tables(lens, BS, num_blocks, seed)
    meta = build_metadata([SeqChunk(t, n - 1, 1) for t, n in zip(tables, lens, strict=True)], BS)
    cache = torch.randn(2, num_blocks, BS, kv_heads, d, generator=g).to(dtype)
    t = len(lens)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    cos = sin = None
    if rope:
        table = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": 10000.0})
        cos, sin = table(meta.seq_lens.long() - 1, dtype)
    return meta, cache, q, k, v, cos, sin


def _run(meta, cache, q, k, v, cos, sin, scale):
    step = cpu_attention.StepArgs(meta.slot_mapping, meta.block_tables, meta.seq_lens, cos, sin)
    assert cpu_attention.fits(q, k, v, cache, cos)
    return cpu_attention.paged_decode(q, k, v, cache, step, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("lens", "heads", "kv_heads", "d"), [
    ([1, 17, 100, 33, 16], 8, 2, 64),  # more tasks than threads: one part each
    ([300], 9, 3, 64),  # a single stream: its blocks split across the threads
    ([3, 70], 4, 1, 64),  # split too, the one-block sequence's second part empty
    ([5, 40], 4, 4, 128),  # no grouping
    ([70, 2, 31], 6, 2, 48),  # a head size the kernel does not specialise
])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no_rope"])
def test_equals_the_torch_reference(lens, heads, kv_heads, d, dtype, rope) -> None:
    meta, cache, q, k, v, cos, sin = _decodes(lens, heads, kv_heads, d, dtype, seed=len(lens),
                                              rope=rope)
    want_cache = cache.clone()
    want = cpu_attention.reference(q, k, v, want_cache, meta.slot_mapping, meta.block_tables,
                                   meta.seq_lens, cos, sin, d**-0.5)
    got = _run(meta, cache, q, k, v, cos, sin, d**-0.5)
    # bf16: the torch reference rounds after every op of the rotation, the kernel once
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02,
                                                                        "atol": 0.02}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(cache, want_cache, **tol)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_does_not_depend_on_the_thread_count_beyond_rounding(threads: int) -> None:
    meta, cache, q, k, v, cos, sin = _decodes([250], 9, 3, 64, torch.float32, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _run(meta, cache.clone(), q, k, v, cos, sin, 0.125)
    finally:
        torch.set_num_threads(before)
    want = cpu_attention.reference(q, k, v, cache, meta.slot_mapping, meta.block_tables,
                                   meta.seq_lens, cos, sin, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_slots_and_block_ids_outside_the_cache_raise() -> None:
    meta, cache, q, k, v, cos, sin = _decodes([20, 9], 4, 2, 64, torch.float32, seed=5)
    meta.slot_mapping[1] = cache.shape[1] * BS  # one past the last slot
    with pytest.raises(ValueError, match="slot outside the cache"):
        _run(meta, cache, q, k, v, cos, sin, 0.125)
    meta, cache, q, k, v, cos, sin = _decodes([20, 9], 4, 2, 64, torch.float32, seed=5)
    meta.block_tables[0, 0] = cache.shape[1]
    with pytest.raises(ValueError, match="block id outside the cache"):
        _run(meta, cache, q, k, v, cos, sin, 0.125)


def test_operands_it_does_not_take_are_refused() -> None:
    meta, cache, q, k, v, cos, sin = _decodes([20], 4, 2, 64, torch.float32, seed=6)
    assert cpu_attention.fits(q, k, v, cache, cos)
    assert not cpu_attention.fits(q, k, v, cache.to(torch.float8_e4m3fn), cos)  # fp8 cache
    assert not cpu_attention.fits(q, k, v, cache.bfloat16(), cos)  # dtypes differ
    assert not cpu_attention.fits(q, k, v, cache, cos.bfloat16())
    assert not cpu_attention.fits(q.transpose(1, 2), k, v, cache, cos)  # heads not D apart
    assert not cpu_attention.fits(q.float().half(), k.half(), v.half(), cache.half(), None)
    big = torch.zeros(1, 34, 64)  # 17 query heads a kv head: more than the kernel holds
    assert not cpu_attention.fits(big, k, v, cache, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_torch_backend_takes_it_for_decodes_and_gives_what_its_ops_give(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta, cache, q, k, v, cos, sin = _decodes([3, 64, 90, 17], 8, 2, 64, dtype, seed=7)
    rope = RopeInputs(cos=cos, sin=sin)
    calls = []
    real = cpu_attention.paged_decode
    monkeypatch.setattr(cpu_attention, "paged_decode",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    backend = TorchAttentionBackend()
    c_cache = cache.clone()
    got = backend.forward(q, k, v, c_cache, meta, 0.125, rope)
    assert calls == [q.shape]
    meta.backend_state = None
    monkeypatch.setattr(torch_backend.cpu_attention, "library", lambda: None)
    want = backend.forward(q, k, v, cache, meta, 0.125, rope)  # the torch ops
    assert len(calls) == 1
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02,
                                                                        "atol": 0.02}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(c_cache, cache, **tol)


def test_the_torch_backend_keeps_its_ops_for_steps_with_a_prefill(monkeypatch) -> None:
    tables = shuffled_block_tables([12, 30], BS, 8, 1)
    meta = build_metadata([SeqChunk(tables[0], 0, 12), SeqChunk(tables[1], 29, 1)], BS)
    cache = torch.zeros(2, 8, BS, 2, 64)
    q, k, v = torch.randn(13, 4, 64), torch.randn(13, 2, 64), torch.randn(13, 2, 64)
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *a: pytest.fail("C path taken"))
    out = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.125)
    assert out.shape == (13, 4, 64)
