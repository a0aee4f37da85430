"""Triton attention kernels against their fp32 torch references.

On CPU these run in Triton's interpreter at small shapes; on a GPU at full size (head_dim 64 and
128, contexts past 1k, a cache of more than 2**31 elements for the index-overflow case)."""

from __future__ import annotations

import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.kv_cache_fp8 import KV_FP8, quantize_kv  # noqa: E402
from kernels.kv_store import store_kv, store_kv_ref  # noqa: E402
from kernels.paged_decode_attention import (  # noqa: E402
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kernels.paged_decode_attention_merged import paged_decode_attention_merged  # noqa: E402
from kernels.prefill_attention import prefill_attention, prefill_attention_ref  # noqa: E402
from kernels.w4a16 import tickets  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (query heads, kv heads): the bundled model's 9/3, Llama-3's 32/8 scaled down, MHA
GQA = [(9, 3), (8, 2), (4, 4)] if not CUDA else [(9, 3), (32, 8), (16, 16)]
HEAD_DIM = 16 if not CUDA else 64
# Relative L2 error bounds against the fp32 reference (bf16: 8 mantissa bits; the interpreter
# also truncates rather than rounds when it casts to bf16).
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def seed_of(*key) -> int:
    """A seed fixed per test case (Python's own hash of a str changes between processes)."""
    return zlib.crc32(repr(key).encode())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen):
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    return cache.to(dtype).to(DEVICE)


def shuffled_tables(num_seqs, blocks_per_seq, num_blocks, gen):
    """Each sequence gets distinct, randomly placed blocks."""
    perm = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq]
    return perm.view(num_seqs, blocks_per_seq).int().to(DEVICE)


# (kernel, split count): the two-kernel path; the merged one with one split, several, and more
# splits than any sequence needs (most programs idle, short sequences written by split 0)
DECODE_CASES = [(paged_decode_attention, 1), (paged_decode_attention, 3),
                (paged_decode_attention_merged, 1), (paged_decode_attention_merged, 3),
                (paged_decode_attention_merged, 64)]


def decode_case_id(case) -> str:
    return f"{case[0].__name__.removeprefix('paged_decode_attention') or '_two'}{case[1]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("case", DECODE_CASES, ids=decode_case_id)
def test_decode_attention_matches_reference(dtype, heads, case):
    kernel, splits = case
    gen = torch.Generator().manual_seed(seed_of(dtype, heads, splits))
    num_heads, kv_heads = heads
    block_size = 4 if not CUDA else 16
    # lengths straddle block and tile edges; 0 is a CUDA-graph padding row (must give zeros)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 0, 40]
    if CUDA:
        lens += [1023, 1024, 1025, 2000]
    blocks_per_seq = -(-max(lens) // block_size)
    num_blocks = len(lens) * blocks_per_seq + 5
    cache = random_cache(num_blocks, block_size, kv_heads, HEAD_DIM, dtype, gen)
    tables = shuffled_tables(len(lens), blocks_per_seq, num_blocks, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    kernel(q, cache[0], cache[1], tables, seq_lens, HEAD_DIM**-0.5,
           num_splits=splits, out=out, block_n=16 if not CUDA else 64)
    ref = paged_decode_attention_ref(q, cache[0], cache[1], tables, seq_lens, HEAD_DIM**-0.5)
    assert not out.isnan().any()
    assert torch.equal(out[5].float(), torch.zeros_like(ref[5]))
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_splits_agree_with_one_split():
    gen = torch.Generator().manual_seed(3)
    cache = random_cache(32, 4, 2, HEAD_DIM, torch.float32, gen)
    tables = shuffled_tables(2, 16, 32, gen)
    seq_lens = torch.tensor([61, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, HEAD_DIM, generator=gen).to(DEVICE)
    one = paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.25, num_splits=1,
                                 block_n=16)
    many = paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.25, num_splits=5,
                                  block_n=16)
    torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("splits", [2, 4, 5, 16])
def test_merged_decode_agrees_with_the_two_kernel_path_and_leaves_tickets_zero(splits):
    """fp32: the in-kernel merge adds the same parts as the reduce kernel (to rounding); every
    ticket it took is back at 0, so the next call (or a CUDA-graph replay) starts clean."""
    gen = torch.Generator().manual_seed(seed_of("merged", splits))
    cache = random_cache(40, 4, 2, HEAD_DIM, torch.float32, gen)
    tables = shuffled_tables(3, 13, 40, gen)
    seq_lens = torch.tensor([49, 17, 52], dtype=torch.int32, device=DEVICE)  # 4, 2, 4 tiles
    q = torch.randn(3, 4, HEAD_DIM, generator=gen).to(DEVICE)
    two = paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.25,
                                 num_splits=splits, block_n=16)
    for _ in range(2):  # a second call reuses the tickets the first left
        one = paged_decode_attention_merged(q, cache[0], cache[1], tables, seq_lens, 0.25,
                                            num_splits=splits, block_n=16)
        torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6)
    assert not tickets(q.device, 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_merged_decode_over_an_fp8_cache(dtype, splits):
    """An fp8 cache with k_scale / v_scale: de-quantized on read like the reference (same
    cache); v_scale applies to each split's part before the merge."""
    gen = torch.Generator().manual_seed(seed_of("merged-fp8", dtype, splits))
    block_size, kv_heads, num_heads = (4, 2, 8) if not CUDA else (16, 8, 32)
    lens = [1, block_size + 1, 5 * block_size - 1, 0, 40] + ([1333, 4096] if CUDA else [])
    per_seq = -(-max(lens) // block_size)
    num_blocks = per_seq * len(lens) + 3
    k_scale, v_scale = 2.0, 0.5
    exact = torch.randn(2, num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen) * 3
    cache = torch.stack([quantize_kv(exact[0], KV_FP8, k_scale),
                         quantize_kv(exact[1], KV_FP8, v_scale)]).to(DEVICE)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    tables = shuffled_tables(len(lens), per_seq, num_blocks, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention_merged(q, cache[0], cache[1], tables, seq_lens, HEAD_DIM**-0.5,
                                        num_splits=splits, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(q, cache[0], cache[1], tables, seq_lens, HEAD_DIM**-0.5,
                                     k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(out[3].float(), torch.zeros_like(ref[3]))
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch: Hopper or later")
def test_decode_by_pdl_between_pdl_gemvs_in_a_cuda_graph_equals_plain_launches():
    """q from a GEMV that lets the next kernel launch early, attention + reduce by PDL, the
    o projection by PDL after them, captured and replayed for new inputs: every replay's
    output is bit for bit that of the same chain launched plainly."""
    from kernels.gemv import GemvBlocks, gemv

    gen = torch.Generator().manual_seed(seed_of("pdl-gpu"))
    block_size, per_seq, batch = 16, 64, 4
    cache = torch.randn(2, per_seq * batch, block_size, 8, 64, generator=gen).bfloat16().cuda()
    tables = shuffled_tables(batch, per_seq, per_seq * batch, gen)
    w_q = (torch.randn(2048, 2048, generator=gen) * 0.02).bfloat16().cuda()
    w_o = (torch.randn(2048, 2048, generator=gen) * 0.02).bfloat16().cuda()
    x = torch.empty(batch, 2048, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor([1, 300, 1024, 17], dtype=torch.int32, device="cuda")

    def chain(pdl: bool) -> torch.Tensor:
        blocks = GemvBlocks(4, 256, 4, pdl=pdl)
        q = gemv(x, w_q, blocks=blocks).view(batch, 32, 64)
        out = paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.125,
                                     num_splits=16, pdl=pdl)
        return gemv(out.view(batch, 2048), w_o, blocks=blocks)

    graphs = {}
    for pdl in (False, True):
        x.copy_(torch.randn(batch, 2048, generator=gen).bfloat16())
        chain(pdl)  # compile outside the capture
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            result = chain(pdl)
        graphs[pdl] = (graphs[pdl], result)
    for _ in range(3):
        x.copy_(torch.randn(batch, 2048, generator=gen).bfloat16())
        outs = []
        for graph, result in graphs.values():
            graph.replay()
            outs.append(result.clone())
        assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


@pytest.mark.skipif(not CUDA, reason="full-size shapes and a CUDA graph: a GPU")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, KV_FP8], ids=str)
def test_merged_decode_gpu_full_size_in_a_cuda_graph(kv_dtype):
    """Llama-3.2-1B's attention (32 q / 8 kv heads x 64, bf16 q, 16-token blocks), splits sized
    for 8k as the decode graphs are, captured once and replayed for new lengths: each replay
    matches the reference and leaves the tickets 0."""
    gen = torch.Generator().manual_seed(seed_of("merged-gpu", kv_dtype))
    block_size, per_seq, batch = 16, 512, 8
    num_blocks = per_seq * batch + 7
    scales = (2.0, 0.5) if kv_dtype != torch.bfloat16 else (1.0, 1.0)
    cache = torch.randn(2, num_blocks, block_size, 8, 64, generator=gen)
    cache = torch.stack([quantize_kv(cache[i], kv_dtype, scales[i]) for i in range(2)]).cuda()
    tables = shuffled_tables(batch, per_seq, num_blocks, gen)
    q = torch.randn(batch, 32, 64, generator=gen).bfloat16().cuda()
    seq_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    splits = default_num_splits(batch, 8, 8192, torch.cuda.get_device_properties().
                                multi_processor_count)
    args = (q, cache[0], cache[1], tables, seq_lens, 0.125)
    kwargs = dict(num_splits=splits, out=out, k_scale=scales[0], v_scale=scales[1])
    seq_lens.fill_(1)
    paged_decode_attention_merged(*args, **kwargs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention_merged(*args, **kwargs)
    for lens in ([1, 127, 128, 129, 0, 1000, 4096, 8192], [8192, 3, 256, 257, 2049, 0, 16, 17]):
        seq_lens.copy_(torch.tensor(lens))
        graph.replay()
        ref = paged_decode_attention_ref(*args, k_scale=scales[0], v_scale=scales[1])
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert not tickets(q.device, 1).any()


def test_default_num_splits_fills_the_gpu_and_respects_bounds():
    assert default_num_splits(batch=1, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 17
    assert default_num_splits(batch=1, num_kv_heads=8, max_seq_len=2048, num_sms=132) == 8
    assert default_num_splits(batch=256, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 1
    assert default_num_splits(batch=32, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 1
    assert default_num_splits(batch=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 1
    assert default_num_splits(batch=1, num_kv_heads=1, max_seq_len=10**6, num_sms=132) == 32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_prefill_attention_matches_reference(dtype, heads):
    """Whole prompts, chunks continuing a cached context, a one-token chunk: one kernel."""
    gen = torch.Generator().manual_seed(seed_of(dtype, heads))
    num_heads, kv_heads = heads
    block_size = 4 if not CUDA else 16
    # (new tokens, earlier cached tokens) per sequence
    shapes = [(5, 0), (37, 3), (1, 10), (20, 19), (16, 16)]
    if CUDA:
        shapes += [(1000, 0), (300, 1029), (129, 127)]
    q_lens = [q for q, _ in shapes]
    lens = [q + c for q, c in shapes]
    blocks_per_seq = -(-max(lens) // block_size)
    num_blocks = len(lens) * blocks_per_seq + 3
    cache = random_cache(num_blocks, block_size, kv_heads, HEAD_DIM, dtype, gen)
    tables = shuffled_tables(len(lens), blocks_per_seq, num_blocks, gen)
    starts = torch.tensor([0] + q_lens).cumsum(0).int().to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache[0], cache[1], tables, starts, seq_lens, HEAD_DIM**-0.5,
                      max(q_lens), out=out)
    ref = prefill_attention_ref(q, cache[0], cache[1], tables, starts, seq_lens, HEAD_DIM**-0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_exactly_the_mapped_slots(dtype):
    gen = torch.Generator().manual_seed(5)
    kv_heads, block_size, num_blocks = 3, 4, 10
    qkv = torch.randn(7, (9 + 2 * kv_heads) * HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, 9 * HEAD_DIM:12 * HEAD_DIM].view(7, kv_heads, HEAD_DIM)  # strided views, as in
    v = qkv[:, 12 * HEAD_DIM:].view(7, kv_heads, HEAD_DIM)  # the model's fused qkv output
    cache = random_cache(num_blocks, block_size, kv_heads, HEAD_DIM, dtype, gen)
    expected = cache.clone()
    slots = torch.tensor([3, -1, 39, 0, 17, -1, 22], device=DEVICE)  # -1: padding, no write
    store_kv(k, v, cache[0], cache[1], slots)
    store_kv_ref(k, v, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)


@pytest.mark.skipif(not CUDA, reason="needs a cache over 2**31 elements (a GPU)")
def test_kernels_index_a_cache_past_int32_offsets():
    """Blocks beyond 2**31 elements: page * stride must be computed in 64 bits."""
    block_size, kv_heads, head_dim = 16, 8, 64
    per_block = block_size * kv_heads * head_dim
    num_blocks = 2**31 // per_block + 64
    cache = torch.empty(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16,
                        device="cuda")
    high = torch.arange(num_blocks - 40, num_blocks, device="cuda").int()  # past the int32 line
    tables = high.view(2, 20)
    cache[:, tables.long()] = torch.randn(2, 2, 20, block_size, kv_heads, head_dim,
                                          device="cuda").bfloat16()
    seq_lens = torch.tensor([320, 301], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 32, head_dim, device="cuda").bfloat16()
    out = paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.125, num_splits=2)
    ref = paged_decode_attention_ref(q, cache[0], cache[1], tables, seq_lens, 0.125)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    starts = torch.tensor([0, 320, 621], dtype=torch.int32, device="cuda")
    qp = torch.randn(621, 32, head_dim, device="cuda").bfloat16()
    out = prefill_attention(qp, cache[0], cache[1], tables, starts, seq_lens, 0.125, 320)
    ref = prefill_attention_ref(qp, cache[0], cache[1], tables, starts, seq_lens, 0.125)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    slots = (tables[0, -1].long() * block_size + torch.arange(3, device="cuda"))
    kv = torch.randn(2, 3, kv_heads, head_dim, device="cuda").bfloat16()
    store_kv(kv[0], kv[1], cache[0], cache[1], slots)
    assert torch.equal(cache[0].view(-1, kv_heads, head_dim)[slots], kv[0])
