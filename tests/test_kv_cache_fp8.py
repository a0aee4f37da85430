"""The fp8 KV cache (`kv_cache_dtype="fp8"`, kernels/kv_cache_fp8.py): kernels against their torch
references, the torch attention path, sizing, the engine against HF, and the P/D transfer.

    kernels       store / rope+store quantize exactly as the reference (the same bytes); decode and
                  prefill attention over an fp8 cache equal their references on that cache, and
                  stay within fp8's error of attention over the unquantized K/V
    engine        the pool is float8_e4m3fn and holds 2x the blocks of bf16 (4x of fp32) in the
                  same bytes; greedy output against HF: vLLM's check_logprobs_close criterion
    P/D           disaggregated with fp8 KV equals colocated with fp8 KV token for token; the
                  header names float8_e4m3fn and the receiver refuses another dtype, writing
                  nothing

On the CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1, which
loads, casts and stores float8_e4m3fn like torch), at small shapes; on a GPU at full size.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Iterator

import pytest
import torch
from disagg_harness import colocated_and_disaggregated, pd_engines, run_all

from decode_svc.convert import layout_to_pb
from decode_svc.receiver import KVReceiver, TransferFailed
from engine.async_engine import AsyncLLMEngine
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.kv_transfer import KVLayout, layout_of, read_slabs
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from kernels.kv_cache_fp8 import (
    FP8_MAX,
    KV_FP8,
    check_scales,
    dequantize_kv,
    index_copy_kv,
    quantize_kv,
)
from kernels.kv_store import store_kv, store_kv_ref
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernels.rope_store import rope_and_store, rope_and_store_ref
from kernels.rotary import cos_sin_cache
from pdserve import LLM, SamplingParams
from protos import decode_pb2

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GQA = [(4, 2), (9, 3)] if not CUDA else [(32, 8), (9, 3)]
HEAD_DIM = 16 if not CUDA else 128
BLOCK = 4 if not CUDA else 16
# e4m3 keeps 3 mantissa bits: a stored value is within 2**-4 (6.25 %) of x / scale. Attention
# averages many such errors: its output over fp8 K/V stays within 8 % (relative L2) of the output
# over the exact K/V for these random inputs (measured: 2-4 %).
FP8_ATTN_TOL = 0.08
# kernel vs reference on the same fp8 cache: only the arithmetic differs (q's dtype on the
# tensor cores, accumulation order)
SAME_CACHE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def fp8_cache(exact: torch.Tensor, scale: float) -> torch.Tensor:
    """An fp8 copy of a cache of exact values (quantized as the store kernels do)."""
    return quantize_kv(exact, KV_FP8, scale)


# ---- the quantization itself -----------------------------------------------------------------
def test_quantize_rounds_to_e4m3_saturates_and_takes_a_scale():
    x = torch.tensor([0.0, 1.0, -1.0625, 3.3, 500.0, -1e4, 447.0])
    q = quantize_kv(x, KV_FP8)
    assert q.dtype == KV_FP8
    assert dequantize_kv(q, torch.float32).tolist() == [0.0, 1.0, -1.0, 3.25, 448.0, -448.0, 448.0]
    scaled = dequantize_kv(quantize_kv(x, KV_FP8, 32.0), torch.float32, 32.0)  # no saturation
    assert ((scaled - x).abs() <= x.abs() * 2**-4).all()
    assert torch.equal(quantize_kv(x, torch.float32), x)  # a non-fp8 cache: as it is
    assert float(torch.finfo(KV_FP8).max) == FP8_MAX == 448.0


def test_scales_apply_to_fp8_caches_only():
    check_scales("op", KV_FP8, 0.5, 2.0)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to an fp8 KV cache"):
        check_scales("op", torch.bfloat16, 0.5, 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        check_scales("op", KV_FP8, 0.0, 1.0)


def test_index_copy_kv_moves_fp8_bytes_on_the_cpu():
    """torch has no CPU index_copy_ for fp8: the uint8 view moves the same bytes."""
    dst = torch.zeros(5, 3, dtype=KV_FP8)
    src = torch.randn(2, 3).to(KV_FP8)
    index_copy_kv(dst, 0, torch.tensor([4, 1]), src)
    assert torch.equal(dst[[4, 1]].view(torch.uint8), src.view(torch.uint8))
    assert dst[[0, 2, 3]].float().abs().sum() == 0


# ---- kernels against their references --------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 4.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_quantizes_exactly_as_the_reference(dtype, scale):
    gen = torch.Generator().manual_seed(seed_of("store", dtype, scale))
    num_blocks, kv_heads, tokens = 7, 3, 11
    k = (torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen) * 300).to(dtype).to(DEVICE)
    v = torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens].to(DEVICE)
    slots[3] = -1  # a padding row: no write
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, HEAD_DIM, dtype=KV_FP8, device=DEVICE)
    ref = cache.clone()
    store_kv(k, v, cache[0], cache[1], slots, k_scale=scale, v_scale=scale / 2)
    store_kv_ref(k, v, ref[0], ref[1], slots, k_scale=scale, v_scale=scale / 2)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    flat = cache.view(2, -1, kv_heads, HEAD_DIM)
    back = dequantize_kv(flat[0, slots[slots >= 0]], torch.float32, scale)
    exact = k[slots >= 0].float().clamp(-FP8_MAX * scale, FP8_MAX * scale)
    # one e4m3 rounding: half a step, 2**-4 relative (normal) or 2**-10 x scale (subnormal)
    assert ((back - exact).abs() <= exact.abs() * 2**-4 + 2**-10 * scale).all()
    assert (flat.float().abs().sum(dim=(0, 2, 3)) > 0).sum() == tokens - 1


def test_store_kv_rounds_every_e4m3_midpoint_to_even_like_torch():
    """Ties, both signs, subnormals, signed zeros, saturation: the bytes torch's cast writes
    (under the interpreter through `_round_to_e4m3`, on a GPU through the hardware cast)."""
    every = torch.arange(256, dtype=torch.uint8).view(KV_FP8).float()
    every = every[~every.isnan()].unique()  # the 253 finite values, -448 .. 448
    mids = (every[1:] + every[:-1]) / 2
    gen = torch.Generator().manual_seed(seed_of("ties"))
    x = torch.cat([mids, torch.randn(1000, generator=gen) * torch.logspace(-4, 3, 1000),
                   torch.tensor([0.0, -0.0, 1e-9, -1e-9, 460.0, -470.0, 448.5])])
    x = torch.cat([x, torch.zeros(-x.numel() % HEAD_DIM)]).view(-1, 1, HEAD_DIM).to(DEVICE)
    cache = torch.zeros(2, x.shape[0], 1, 1, HEAD_DIM, dtype=KV_FP8, device=DEVICE)
    store_kv(x, x, cache[0], cache[1], torch.arange(x.shape[0], device=DEVICE))
    want = quantize_kv(x, KV_FP8).view(torch.uint8)
    assert torch.equal(cache[0].view(x.shape[0], 1, HEAD_DIM).view(torch.uint8), want)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_rope_and_store_quantizes_the_rotated_k_like_the_reference(scale):
    gen = torch.Generator().manual_seed(seed_of("rope", scale))
    heads, kv_heads, tokens, num_blocks = 4, 2, 9, 5
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen).to(DEVICE)
    k = torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen).to(DEVICE)
    v = torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen).to(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens].to(DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    cos_sin = cos_sin_cache(inv_freq, 64, torch.device(DEVICE))
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, HEAD_DIM, dtype=KV_FP8, device=DEVICE)
    ref, q_ref = cache.clone(), q.clone()
    rope_and_store(positions, q, k, v, cache[0], cache[1], slots, cos_sin, scale, scale)
    rope_and_store_ref(positions, q_ref, k, v, ref[0], ref[1], slots, cos_sin, scale, scale)
    torch.testing.assert_close(q, q_ref)
    assert torch.equal(cache[1].view(torch.uint8), ref[1].view(torch.uint8))  # v: copied
    # k: rotated in fp32 by both; the kernel rounds once, to e4m3: at most one e4m3 step apart
    got, want = dequantize_kv(cache[0], torch.float32), dequantize_kv(ref[0], torch.float32)
    assert ((got - want).abs() <= want.abs() * 2**-3 + 2**-9).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_over_an_fp8_cache(dtype, heads, splits):
    gen = torch.Generator().manual_seed(seed_of("decode", dtype, heads, splits))
    num_heads, kv_heads = heads
    lens = [1, BLOCK + 1, 5 * BLOCK - 1, 3] if not CUDA else [1, 17, 4000, 1333, 4096]
    per_seq = max(-(-n // BLOCK) for n in lens)
    num_blocks = per_seq * len(lens) + 3
    k_scale, v_scale = 2.0, 0.5
    exact = torch.randn(2, num_blocks, BLOCK, kv_heads, HEAD_DIM, generator=gen) * 3
    cache = torch.stack([fp8_cache(exact[0], k_scale), fp8_cache(exact[1], v_scale)]).to(DEVICE)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_seq]
    tables = tables.view(len(lens), per_seq).int().to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    out = paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, scale, num_splits=splits,
                                 k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(q, cache[0], cache[1], tables, seq_lens, scale,
                                     k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out, ref) < SAME_CACHE_TOL[dtype]
    unquantized = paged_decode_attention_ref(q, exact[0].to(DEVICE), exact[1].to(DEVICE), tables,
                                             seq_lens, scale)
    assert rel_err(out, unquantized) < FP8_ATTN_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_prefill_attention_over_a_paged_fp8_prefix(dtype, heads):
    """Chunks continuing sequences whose earlier tokens sit in the fp8 cache (a prefix-cache hit,
    a chunked prefill), and one whole prompt."""
    gen = torch.Generator().manual_seed(seed_of("prefill", dtype, heads))
    num_heads, kv_heads = heads
    chunks = [(0, 2 * BLOCK + 1), (3 * BLOCK - 1, 5), (BLOCK, 2 * BLOCK)]  # (cached, new)
    if CUDA:
        chunks = [(0, 300), (2047, 129), (512, 1000)]
    lens = [c + n for c, n in chunks]
    per_seq = max(-(-n // BLOCK) for n in lens)
    num_blocks = per_seq * len(lens) + 2
    k_scale, v_scale = 0.5, 1.0
    exact = torch.randn(2, num_blocks, BLOCK, kv_heads, HEAD_DIM, generator=gen)
    cache = torch.stack([fp8_cache(exact[0], k_scale), fp8_cache(exact[1], v_scale)]).to(DEVICE)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_seq]
    tables = tables.view(len(lens), per_seq).int().to(DEVICE)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    out = prefill_attention(q, cache[0], cache[1], tables, qsl, seq_lens, scale,
                            max(n for _, n in chunks), k_scale=k_scale, v_scale=v_scale)
    ref = prefill_attention_ref(q, cache[0], cache[1], tables, qsl, seq_lens, scale,
                                k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out, ref) < SAME_CACHE_TOL[dtype]
    unquantized = prefill_attention_ref(q, exact[0].to(DEVICE), exact[1].to(DEVICE), tables, qsl,
                                        seq_lens, scale)
    assert rel_err(out, unquantized) < FP8_ATTN_TOL


def test_torch_backend_reads_the_fp8_cache_like_the_references():
    """The CPU path (engine/attention/torch_backend.py): a chunk over a cached fp8 prefix and
    two decodes, against the kernels' references on the cache it wrote."""
    from _model_helpers import SeqChunk, build_metadata

    gen = torch.Generator().manual_seed(seed_of("torch backend"))
    heads, kv_heads, block, num_blocks = 4, 2, 4, 12
    chunks = [SeqChunk([3, 7, 1], 5, 6), SeqChunk([0, 9], 6, 1), SeqChunk([5, 2, 11], 10, 1)]
    meta = build_metadata(chunks, block)
    cache = torch.zeros(2, num_blocks, block, kv_heads, HEAD_DIM, dtype=KV_FP8)
    prior = (torch.randn(2, num_blocks, block, kv_heads, HEAD_DIM, generator=gen) * 4)
    cache.copy_(quantize_kv(prior, KV_FP8, 0.5))  # the earlier tokens' K/V, scale 0.5
    tokens = meta.num_tokens
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen) * 4
    v = torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen) * 4
    out = TorchAttentionBackend(k_scale=0.5, v_scale=0.5).forward(q, k, v, cache, meta, 0.25)
    ref_cache = quantize_kv(prior, KV_FP8, 0.5)
    store_kv_ref(k, v, ref_cache[0], ref_cache[1], meta.slot_mapping, 0.5, 0.5)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    split = meta.num_prefill_tokens
    prefill = prefill_attention_ref(q[:split], cache[0], cache[1], meta.block_tables[:1],
                                    meta.query_start_loc[:2], meta.seq_lens[:1], 0.25, 0.5, 0.5)
    decode = paged_decode_attention_ref(q[split:], cache[0], cache[1], meta.block_tables[1:],
                                        meta.seq_lens[1:], 0.25, 0.5, 0.5)
    torch.testing.assert_close(out[:split], prefill, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[split:], decode, rtol=1e-4, atol=1e-5)


def test_block_copy_moves_fp8_blocks_as_bytes():
    """kernels/kv_block_copy.py (cuda_ipc's same-GPU write; the interpreter on a CPU) on fp8
    pools equals its reference, which equals torch indexing."""
    from kernels.kv_block_copy import copy_kv_blocks, ref_copy_kv_blocks

    gen = torch.Generator().manual_seed(seed_of("copy"))
    src = torch.randn(3, 2, 10, BLOCK, 2, HEAD_DIM, generator=gen).to(KV_FP8).to(DEVICE)
    dst = torch.randn(3, 2, 12, BLOCK, 2, HEAD_DIM, generator=gen).to(KV_FP8).to(DEVICE)
    before, ref = dst.clone(), dst.clone()
    src_ids = torch.tensor([4, 5, 6, 0], device=DEVICE)
    dst_ids = torch.tensor([9, 10, 11, 2], device=DEVICE)
    copy_kv_blocks(src, dst, 1, 3, src_ids, dst_ids)
    ref_copy_kv_blocks(src, ref, 1, 3, src_ids, dst_ids)
    assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8))
    want = before.clone()
    want.view(torch.uint8)[1:3, :, dst_ids] = src.view(torch.uint8)[1:3, :, src_ids]
    assert not torch.equal(want.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(ref.view(torch.uint8), want.view(torch.uint8))


# ---- the engine ------------------------------------------------------------------------------
def test_config_takes_vllm_names_and_refuses_others():
    assert EngineConfig(model="m").kv_cache_dtype == "auto"
    for name in ("fp8", "fp8_e4m3"):
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="int8")


@pytest.mark.parametrize(("dtype", "ratio"), [("bfloat16", 2), ("float32", 4)])
def test_the_same_memory_holds_more_fp8_blocks(tiny_llama_dir, dtype, ratio):
    """Tiny Llama: 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims = 2048 elements a block:
    4096 B in bf16, 2048 B in fp8; 1 MiB holds 256 and 512 blocks."""
    def runner(kv_cache_dtype: str):
        config = build_engine_config(tiny_llama_dir, dtype=dtype, device="cpu",
                                     kv_cache_memory=1 << 20, kv_cache_dtype=kv_cache_dtype)
        return LLMEngine(config).runner

    auto, fp8 = runner("auto"), runner("fp8")
    assert fp8.kv_pool.dtype == KV_FP8 and fp8.block_bytes() == 2048
    assert fp8.num_blocks == 512 == ratio * auto.num_blocks
    assert fp8.kv_pool.nbytes == auto.kv_pool.nbytes == 1 << 20


@pytest.fixture(scope="module")
def fp8_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", seed=0, kv_cache_dtype="fp8",
               kv_cache_memory=8 << 20)


def test_greedy_with_fp8_kv_tracks_hf(tiny_llama_dir, fp8_llm, hf_oracle):
    """vLLM's check_logprobs_close: wherever the fp8 run's greedy tokens leave the exact run's
    (pdserve with a float32 cache, which equals HF token for token, asserted here too), each
    side's token is among the other's top-5 at that position; after it the runs diverge and
    are not compared. On the CPU the first token of every prompt equals HF's exactly: the
    prompt's own forward attends its K/V as computed, fp8 only enters from the first decode on.

    This random tiny model's next-token distribution is nearly flat (top logprobs within 0.2 of
    each other), so fp8's 2**-4 rounding flips near-ties after a few tokens: measured, the runs
    agree for 1 to 10 tokens. On the bundled SmolLM2-135M 5 of 8 prompts agree for all 32
    tokens (docs)."""
    from test_llm_vs_hf import PROMPTS

    from engine.model_loader import load_hf_model

    exact = LLM(tiny_llama_dir, dtype="float32", seed=0, kv_cache_memory=8 << 20)
    prompts = [exact.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    ref = [o.outputs[0] for o in exact.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in fp8_llm.generate(prompts, params, use_tqdm=False)]
    hf = hf_oracle(load_hf_model(tiny_llama_dir, torch.float32), prompts, 16,
                   exact.llm_engine.eos_token_ids)
    assert [r.token_ids for r in ref] == hf
    assert fp8_llm.llm_engine.runner.kv_pool.dtype == KV_FP8
    if fp8_llm.llm_engine.runner.backend.name == "torch":  # Triton's prefill reads the cache
        assert [g.token_ids[0] for g in got] == [h[0] for h in hf]
    differs = False
    for r, g in zip(ref, got):
        for pos, (a, b) in enumerate(zip(r.token_ids, g.token_ids)):
            differs |= r.logprobs[pos][a] != g.logprobs[pos][b]
            if a != b:
                assert b in r.logprobs[pos] and a in g.logprobs[pos], (pos, a, b)
                break
    assert differs  # the fp8 cache was read: its logprobs are not the exact run's


@pytest.mark.skipif(CUDA, reason="the CPU path (torch attention backend)")
def test_the_fp8_engine_equals_a_float32_engine_fed_fp8_rounded_kv(tiny_llama_dir, fp8_llm,
                                                                   monkeypatch):
    """The exact check of the whole fp8 path, whatever the model's margins: a float32 cache
    whose store rounds K and V through e4m3 holds the values the fp8 cache de-quantizes to, so
    every token and every logprob is the same, bit for bit."""
    import engine.attention.torch_backend as torch_backend

    real = torch_backend.store_kv

    def rounded(k, v, kv_cache, slots, k_scale=1.0, v_scale=1.0):
        real(dequantize_kv(quantize_kv(k, KV_FP8), k.dtype),
             dequantize_kv(quantize_kv(v, KV_FP8), v.dtype), kv_cache, slots)

    monkeypatch.setattr(torch_backend, "store_kv", rounded)
    # the emulation rounds in the torch ops' store: keep those ops (the C decode path stores
    # its own way; the fp8 engine never takes it)
    monkeypatch.setattr(torch_backend.cpu_attention, "library", lambda: None)
    emulated = LLM(tiny_llama_dir, dtype="float32", seed=0, kv_cache_memory=8 << 20)
    prompts = [[1, 17, 230, 58, 901, 44, 12, 7] * 5, [1, 505, 13, 99], list(range(300, 340))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    want = [o.outputs[0] for o in emulated.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in fp8_llm.generate(prompts, params, use_tqdm=False)]
    assert emulated.llm_engine.runner.kv_pool.dtype == torch.float32
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]


def test_prefix_cache_hits_read_the_fp8_blocks(fp8_llm):
    """Requests sharing a 3-block prefix with an earlier one read those blocks from the fp8
    cache: the same tokens every time, within fp8's reach of the cold run (which attended the
    prefix as computed): at their first difference, each token is in the other's top 5."""
    prompt = list(range(200, 248)) + [7, 8]  # a 48-token prefix: 3 whole blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    cold, warm, again = (fp8_llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(3))
    assert [o.num_cached_tokens for o in (cold, warm, again)] == [0, 48, 48]
    assert warm.outputs[0].token_ids == again.outputs[0].token_ids
    ref, got = cold.outputs[0], warm.outputs[0]
    for pos, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        if a != b:
            assert b in ref.logprobs[pos] and a in got.logprobs[pos], (pos, a, b)
            break


def test_a_draft_model_keeps_its_own_kv_dtype_and_greedy_output_is_unchanged(tiny_llama_dir,
                                                                              fp8_llm):
    """Speculative decoding with the target as its own draft: the target's cache is fp8, the
    draft's stays float32 (its own cache, engine/spec_decode/draft_model.py); verification
    keeps greedy output that of plain decoding over the fp8 cache."""
    spec = LLM(tiny_llama_dir, dtype="float32", seed=0, kv_cache_dtype="fp8",
               kv_cache_memory=8 << 20,
               speculative_config={"model": tiny_llama_dir, "num_speculative_tokens": 3})
    runner = spec.llm_engine.runner
    assert runner.kv_pool.dtype == KV_FP8
    assert runner.drafter.kv_caches[0].dtype == torch.float32
    prompts = [[1, 17, 230, 58, 901, 44, 12, 7], [1, 640, 641, 642, 77, 9] * 3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in fp8_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec.llm_engine.stats().spec_decode_num_accepted_tokens > 0


def test_lora_adapters_run_over_an_fp8_cache(tiny_llama_dir, tmp_path):
    """LoRA does not touch the cache: an adapter's greedy tokens equal PEFT's with a float32
    cache, and its first token does with an fp8 one (the prompt attends its K/V as computed;
    later tokens read the fp8 cache: test_greedy_with_fp8_kv_tracks_hf)."""
    from lora_helpers import make_adapter
    from test_lora import PROMPTS, _oracle

    from engine.lora.request import LoRARequest

    adapter = LoRARequest("a", 1, make_adapter(tiny_llama_dir, tmp_path / "a", rank=8,
                                               scale=3.0))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=8 << 20,
                  kv_cache_dtype=kv, enable_lora=True, max_lora_rank=8)
        outs[kv] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                       lora_request=adapter)]
    peft = _oracle(tiny_llama_dir, adapter.lora_path)
    assert [o.token_ids for o in outs["auto"]] == [p[:8] for p in peft]
    assert [o.token_ids[0] for o in outs["fp8"]] == [p[0] for p in peft]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and the Triton backend: a GPU")
def test_cuda_graphs_replay_decode_steps_over_the_fp8_cache_like_eager_ones(cuda_llama_dir):
    """bf16 model, fp8 KV: decode steps replayed from CUDA graphs give the greedy tokens of the
    same steps run eagerly. 8 prompts of 280 tokens prefilled in one step keep every decode step
    a batch of 8 (a captured size), and max_model_len 512 gives the graphs the 2 context splits
    the eager steps pick: the same kernels over the same cache either way. (Against a bf16
    cache this random model's near-flat logits flip within a few tokens, even the first:
    measured on an H100, a first token outside the other's top 5.)"""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (280,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(cuda_llama_dir, dtype="bfloat16", kv_cache_dtype="fp8", enforce_eager=eager,
                  max_model_len=512, max_num_seqs=8, max_num_batched_tokens=4096,
                  gpu_memory_utilization=0.3)
        runner = llm.llm_engine.runner
        assert runner.kv_pool.dtype == KV_FP8 and runner.backend.name == "triton"
        tokens[eager] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (runner.graphs is None) == eager
        if not eager:
            assert runner.graphs.replays > 0  # decode steps went through the captured graphs
        del llm, runner
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
    assert all(len(t) == 32 for t in tokens[False])


# ---- the P/D transfer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_engines(tiny_llama_dir):
    return pd_engines(tiny_llama_dir, num_kv_blocks=64, kv_cache_dtype="fp8")


@pytest.mark.parametrize("max_bytes", [4 << 20, 700])  # whole layers per slab; block pieces
def test_disaggregated_fp8_equals_colocated_fp8(fp8_engines, max_bytes):
    expected, decoded = colocated_and_disaggregated(*fp8_engines, max_bytes)
    decode = fp8_engines[2]
    assert [d[:1] + d[2:] for d in decoded] == expected
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_fp8_pushes_between_tensor_parallel_workers(prefill_tp, decode_tp, tiny_llama_dir):
    """Rank 0 reads and writes every rank's fp8 heads (engine/distributed/kv_shards.py, byte
    views); the split equals the colocated fp8 engine token for token."""
    from test_tp_disagg import PARAMS, PROMPTS, _split

    def engine(role: str, tp: int) -> LLMEngine:
        return LLMEngine(build_engine_config(tiny_llama_dir, device="cpu", role=role,
                                             num_kv_blocks=48, tensor_parallel_size=tp,
                                             kv_cache_dtype="fp8"))

    colocated = engine("colocated", 1)
    for i, p in enumerate(PROMPTS):
        colocated.add_request(f"r{i}", p, PARAMS)
    expected = [out.outputs[0].token_ids for _, out in sorted(run_all(colocated).items())]
    prefill, decode = engine("prefill", prefill_tp), engine("decode", decode_tp)
    try:
        assert layout_of(decode.runner.kv_view()).dtype == "float8_e4m3fn"
        assert _split(prefill, decode, max_bytes=700) == expected
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_push_moves_a_quarter_of_the_fp32_bytes(fp8_engines):
    """The header's layout names float8_e4m3fn; a block of one layer is 2 x 16 x 2 x 16 x 1 B."""
    _, prefill, _ = fp8_engines
    layout = layout_of(prefill.runner.kv_caches)
    assert layout == KVLayout(2, 2, 16, "float8_e4m3fn", 16)
    assert layout.cell_bytes() == 1024 == KVLayout(2, 2, 16, "float32", 16).cell_bytes() // 4
    prefill.add_request("bytes", list(range(100, 140)), SamplingParams(max_tokens=1))
    run_all(prefill)
    slabs = list(read_slabs(prefill.runner.kv_caches, prefill.held_block_ids("bytes")))
    assert sum(len(s.data) for s in slabs) == 2 * 3 * 1024  # 2 layers x 3 blocks
    assert prefill.release("bytes")


def test_a_grpc_slab_of_an_fp8_cache_carries_its_bytes_and_lands_as_them():
    """The prefill worker's stager (prefill_svc/sender.py: a uint8 staging buffer, a pinned host
    copy on a GPU) makes the KVChunk protobuf would make of the fp8 bytes; the decode side's
    writer puts the same bytes into its own blocks."""
    from engine.kv_transfer import KVSlab, KVSlabWriter
    from prefill_svc.push import SlabTicket
    from prefill_svc.slab_stager import SlabStager

    gen = torch.Generator().manual_seed(seed_of("grpc"))
    caches = [torch.randn(2, 20, 16, 2, 8, generator=gen).to(KV_FP8).to(DEVICE)
              for _ in range(4)]
    message = SlabStager(caches).encode(SlabTicket((1, 3, 0, 2), (17, 4), epoch=0))
    data = torch.stack([c.view(torch.uint8)[:, [17, 4]] for c in caches[1:3]]).cpu()
    assert message == decode_pb2.KVChunk(data=decode_pb2.KVData(
        layer_start=1, layer_end=3, block_start=0, block_end=2,
        data=data.numpy().tobytes())).SerializeToString()
    received = [torch.zeros_like(c) for c in caches]
    writer = KVSlabWriter(received, [5, 9])
    writer.write(KVSlab(1, 3, 0, 2, decode_pb2.KVChunk.FromString(message).data.data))
    assert writer.bytes_received == 2 * 2 * (2 * 16 * 2 * 8)  # layers x blocks x cell, 1 B
    for layer in (1, 2):
        assert torch.equal(received[layer].view(torch.uint8)[:, [5, 9]],
                           caches[layer].view(torch.uint8)[:, [17, 4]])


def test_a_layout_of_another_dtype_is_refused_with_the_flags_to_fix():
    fp8, bf16 = KVLayout(2, 2, 16, "float8_e4m3fn", 16), KVLayout(2, 2, 16, "bfloat16", 16)
    with pytest.raises(ValueError) as info:
        fp8.check_compatible(bf16)
    assert str(info.value) == (
        "KV layout mismatch: dtype: sender bfloat16 != receiver float8_e4m3fn; prefill and "
        "decode workers need the same --dtype and --kv-cache-dtype")
    fp8.check_compatible(KVLayout(2, 2, 16, "float8_e4m3fn", 16))


PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
FP8_CELL = 2 * 16 * 2 * 16  # (K, V) x tokens x kv heads x head dim x 1 B


@pytest.fixture(scope="module")
def fp8_decode(tiny_llama_dir: str) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", role="decode",
                                      kv_cache_dtype="fp8", num_kv_blocks=16, max_model_len=256,
                                      enable_prefix_caching=False)
    yield engine
    engine.shutdown()


async def _chunks(dtype: str, fill: int) -> AsyncIterator[decode_pb2.KVChunk]:
    layout = KVLayout(2, 2, 16, dtype, 16)
    yield decode_pb2.KVChunk(header=decode_pb2.KVHeader(
        request_id="r", layout=layout_to_pb(layout), num_tokens=len(PROMPT), num_blocks=3))
    await asyncio.sleep(0)
    yield decode_pb2.KVChunk(data=decode_pb2.KVData(
        layer_start=0, layer_end=2, block_start=0, block_end=3,
        data=bytes([fill]) * 6 * layout.cell_bytes()))
    yield decode_pb2.KVChunk(commit=decode_pb2.KVCommit(first_token_id=7))


async def test_the_receiver_refuses_a_push_of_another_dtype_and_writes_nothing(fp8_decode):
    receiver = KVReceiver(fp8_decode)
    kv = fp8_decode.engine.runner.kv_caches
    assert await receiver.expect("r", PROMPT, PARAMS)
    before = [layer.view(torch.uint8).clone() for layer in kv]
    with pytest.raises(ValueError, match="dtype: sender bfloat16 != receiver float8_e4m3fn"):
        await receiver.receive(_chunks("bfloat16", fill=0x3C))
    assert all(torch.equal(layer.view(torch.uint8), was) for layer, was in zip(kv, before))
    with pytest.raises(TransferFailed, match="--kv-cache-dtype"):
        await receiver.wait("r", 5)
    assert (await fp8_decode.stats()).num_free_blocks == 16

    assert await receiver.expect("r", PROMPT, PARAMS)  # an fp8 push of the same request lands
    blocks = receiver.pending["r"].block_ids
    assert await receiver.receive(_chunks("float8_e4m3fn", fill=0x38)) == 6 * FP8_CELL
    # 0x38 is e4m3's 1.0 (blocks 0, 1: prompt only; decoding writes into block 2)
    assert set(kv[1][:, blocks[:2]].float().reshape(-1).tolist()) == {1.0}
    assert await receiver.wait("r", 5)
    outs = [out async for out in fp8_decode.stream("r")]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


# ---- the flag --------------------------------------------------------------------------------
def test_every_serving_command_takes_the_flag_with_its_env_fallback(monkeypatch):
    import argparse

    from pdserve import launcher
    from pdserve.cli import _add_engine_args, _engine_kwargs
    from pdserve.cluster.worker import add_engine_flags

    monkeypatch.setenv("PDSERVE_KV_CACHE_DTYPE", "fp8")
    for add in (add_engine_flags, launcher.add_arguments):  # serve, prefill, decode; up
        parser = argparse.ArgumentParser()
        add(parser)
        assert parser.parse_args([]).kv_cache_dtype == "fp8"
        assert parser.parse_args(["--kv-cache-dtype", "auto"]).kv_cache_dtype == "auto"
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-dtype", "int8"])
    parser = argparse.ArgumentParser()  # generate, demo: flags only, as their other flags
    _add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert _engine_kwargs(args)["kv_cache_dtype"] == "fp8_e4m3"
    up = argparse.ArgumentParser()
    launcher.add_arguments(up)
    plan = launcher.plan(up.parse_args([]), "redis://127.0.0.1:1/0", None)
    workers = [s.argv for s in plan if s.name.startswith(("prefill", "decode"))]
    assert workers and all(argv[argv.index("--kv-cache-dtype") + 1] == "fp8" for argv in workers)


def test_the_chart_hands_the_flag_to_both_workers_and_refuses_a_mismatch(monkeypatch):
    helm = pytest.importorskip("helm_python")
    from test_helm_chart import WORKERS, parse_as_service, render

    rendered = render({"engine": {"flags": {"kv-cache-dtype": "fp8"}}})
    for role in WORKERS:
        assert rendered.env(role)["PDSERVE_KV_CACHE_DTYPE"] == "fp8"
        assert parse_as_service(role, rendered.env(role), monkeypatch).kv_cache_dtype == "fp8"
    with pytest.raises(helm.HelmRenderError, match="must share --kv-cache-dtype"):
        render({"prefill": {"flags": {"kv-cache-dtype": "fp8"}}})
