"""kernels/kv_block_copy.py: the Triton block copy against its torch reference, the reference
against a plain loop. A copy is exact: every assert is equality.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1) at small, odd
shapes; on a GPU a pool past 2**31 elements checks the int64 offsets."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

import kernels.kv_block_copy as kv_block_copy  # noqa: E402
from kernels.kv_block_copy import copy_kv_blocks, ref_copy_kv_blocks  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KERNEL = CUDA or kv_block_copy.INTERPRET
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (block_size, kv heads, head_dim): odd sizes, one element, and a power-of-2 block
SHAPES = [(3, 5, 7), (1, 1, 1), (4, 2, 16)]


def seed_of(*key) -> int:
    """A seed fixed per test case (Python's own hash of a str changes between processes)."""
    return zlib.crc32(repr(key).encode())


def random_pool(layers, num_blocks, shape, dtype, gen) -> torch.Tensor:
    """[L, 2, N, block_size, Hkv, D] of distinct-enough random values."""
    return torch.randn(layers, 2, num_blocks, *shape, generator=gen).to(dtype).to(DEVICE)


def random_ids(n, num_blocks, gen) -> torch.Tensor:
    """n distinct block ids in random order."""
    return torch.randperm(num_blocks, generator=gen)[:n].to(DEVICE)


def naive_copy(src, dst, layer_start, layer_end, src_ids, dst_ids) -> None:
    for layer in range(layer_start, layer_end):
        for kv in range(2):
            for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
                dst[layer, kv, d] = src[layer, kv, s]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(dtype, shape):
    """Shuffled ids, a layer sub-range, pools of different sizes, chunks with a short tail."""
    gen = torch.Generator().manual_seed(seed_of(dtype, shape))
    src = random_pool(4, 9, shape, dtype, gen)
    dst = random_pool(4, 13, shape, dtype, gen)
    src_ids, dst_ids = random_ids(6, 9, gen), random_ids(6, 13, gen)
    expected = dst.clone()
    ref_copy_kv_blocks(src, expected, 1, 3, src_ids, dst_ids)
    copy_kv_blocks(src, dst, 1, 3, src_ids, dst_ids, block=16)
    assert torch.equal(dst, expected)
    assert torch.equal(dst[1:3, :, dst_ids], src[1:3, :, src_ids])


@needs_kernel
def test_only_the_named_layers_and_blocks_change():
    gen = torch.Generator().manual_seed(1)
    src = random_pool(5, 6, (3, 5, 7), torch.bfloat16, gen)
    dst = random_pool(5, 11, (3, 5, 7), torch.bfloat16, gen)
    before = dst.clone()
    src_ids = torch.tensor([4, 0, 5], device=DEVICE)
    dst_ids = torch.tensor([9, 2, 6], device=DEVICE)
    copy_kv_blocks(src, dst, 2, 4, src_ids, dst_ids)
    for layer in range(5):
        for kv in range(2):
            for block in range(11):
                if 2 <= layer < 4 and block in (9, 2, 6):
                    want = src[layer, kv, [4, 0, 5][[9, 2, 6].index(block)]]
                else:
                    want = before[layer, kv, block]
                assert torch.equal(dst[layer, kv, block], want), (layer, kv, block)


@needs_kernel
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=str)
def test_strided_ids_of_either_int_dtype(id_dtype):
    """Ids read through a stride: a column of a block table, every other id of a list."""
    gen = torch.Generator().manual_seed(seed_of(id_dtype))
    src = random_pool(2, 10, (5, 3, 4), torch.float16, gen)
    dst = random_pool(2, 7, (5, 3, 4), torch.float16, gen)
    table = torch.tensor([[8, 1], [3, 6], [0, 4]], dtype=id_dtype, device=DEVICE)
    dst_ids = torch.tensor([5, 9, 0, 9, 2, 9], dtype=id_dtype, device=DEVICE)[::2]
    assert not table[:, 0].is_contiguous() and not dst_ids.is_contiguous()
    expected = dst.clone()
    naive_copy(src, expected, 0, 2, table[:, 0], dst_ids)
    copy_kv_blocks(src, dst, 0, 2, table[:, 0], dst_ids, block=32)
    assert torch.equal(dst, expected)


@needs_kernel
def test_copy_within_one_pool():
    """src is dst (e.g. copy-on-write of a shared prefix block), the two id lists disjoint."""
    gen = torch.Generator().manual_seed(2)
    pool = random_pool(3, 8, (2, 3, 5), torch.float32, gen)
    expected = pool.clone()
    src_ids, dst_ids = torch.tensor([1, 6], device=DEVICE), torch.tensor([7, 0], device=DEVICE)
    naive_copy(expected.clone(), expected, 0, 3, src_ids, dst_ids)
    copy_kv_blocks(pool, pool, 0, 3, src_ids, dst_ids)
    assert torch.equal(pool, expected)


@needs_kernel
def test_the_kernel_runs_not_the_reference(monkeypatch):
    """On CUDA, or on CPU under the interpreter, the Triton kernel does the copy."""

    def no_reference(*args):
        raise AssertionError("the torch reference ran")

    monkeypatch.setattr(kv_block_copy, "ref_copy_kv_blocks", no_reference)
    gen = torch.Generator().manual_seed(3)
    src = random_pool(1, 3, (2, 2, 2), torch.float32, gen)
    dst = torch.zeros_like(src)
    ids = torch.tensor([2, 0, 1], device=DEVICE)
    copy_kv_blocks(src, dst, 0, 1, ids, ids)
    assert torch.equal(dst, src)


@pytest.mark.skipif(CUDA, reason="the fallback is the CPU path")
def test_cpu_without_interpreter_falls_back_to_the_reference(monkeypatch):
    class NoKernel:
        def __getitem__(self, grid):
            raise AssertionError("the Triton kernel ran")

    monkeypatch.setattr(kv_block_copy, "INTERPRET", False)
    monkeypatch.setattr(kv_block_copy, "_copy_blocks_kernel", NoKernel())
    gen = torch.Generator().manual_seed(4)
    src = random_pool(2, 4, (3, 1, 2), torch.bfloat16, gen)
    dst = random_pool(2, 5, (3, 1, 2), torch.bfloat16, gen)
    src_ids, dst_ids = torch.tensor([3, 0]), torch.tensor([1, 4])
    expected = dst.clone()
    naive_copy(src, expected, 0, 2, src_ids, dst_ids)
    copy_kv_blocks(src, dst, 0, 2, src_ids, dst_ids)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_equals_a_plain_loop(dtype):
    gen = torch.Generator().manual_seed(seed_of("ref", dtype))
    src = random_pool(3, 7, (3, 2, 5), dtype, gen)
    dst = random_pool(3, 4, (3, 2, 5), dtype, gen)
    src_ids, dst_ids = random_ids(4, 7, gen), random_ids(4, 4, gen)
    expected = dst.clone()
    naive_copy(src, expected, 1, 3, src_ids, dst_ids)
    ref_copy_kv_blocks(src, dst, 1, 3, src_ids, dst_ids)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("layers", [(0, 2), (1, 1)], ids=["no-ids", "no-layers"])
def test_nothing_to_copy_is_a_no_op(layers):
    gen = torch.Generator().manual_seed(5)
    src, dst = random_pool(2, 3, (2, 2, 2), torch.float32, gen), torch.zeros(2, 2, 3, 2, 2, 2)
    dst = dst.to(DEVICE)
    n = 0 if layers == (0, 2) else 2
    ids = torch.arange(n, device=DEVICE)
    copy_kv_blocks(src, dst, *layers, ids, ids)
    assert torch.equal(dst, torch.zeros_like(dst))


def _bad_args() -> dict[str, tuple]:
    """Each case: the call's arguments, one of them wrong, and a piece of the message."""
    pool = torch.zeros(3, 2, 4, 2, 2, 8, device=DEVICE)
    ids = torch.tensor([0, 1], device=DEVICE)
    other = torch.zeros(3, 2, 6, 2, 2, 8, device=DEVICE)
    swapped = torch.zeros(3, 2, 4, 2, 8, 2, device=DEVICE)
    return {
        "src-not-6d": ((pool[0], other, 0, 1, ids, ids), "must be [L, 2, N"),
        "not-k-and-v": ((pool[:, :1], other, 0, 1, ids, ids), "must be [L, 2, N"),
        "head-dim": ((pool, other[..., :4].contiguous(), 0, 1, ids, ids), "may differ only"),
        "layer-count": ((pool, other[:2].clone(), 0, 1, ids, ids), "may differ only"),
        "dtype-mismatch": ((pool, other.half(), 0, 1, ids, ids), "one dtype"),
        "int-pool": ((pool.long(), other.long(), 0, 1, ids, ids), "one dtype"),
        "not-contiguous": ((swapped.transpose(4, 5), other, 0, 1, ids, ids), "contiguous"),
        "dst-strided-blocks": ((pool, other[:, :, ::2], 0, 1, ids, ids), "contiguous"),
        "negative-start": ((pool, other, -1, 1, ids, ids), "not within"),
        "end-past-layers": ((pool, other, 1, 4, ids, ids), "not within"),
        "end-before-start": ((pool, other, 2, 1, ids, ids), "not within"),
        "id-lengths": ((pool, other, 0, 1, ids, ids[:1]), "one length"),
        "ids-2d": ((pool, other, 0, 1, ids[None], ids[None]), "1-D"),
        "float-ids": ((pool, other, 0, 1, ids.float(), ids), "int64 or int32"),
        "int16-ids": ((pool, other, 0, 1, ids, ids.short()), "int64 or int32"),
        "ids-on-meta": ((pool, other, 0, 1, ids, ids.to("meta")), "share a device"),
        "dst-on-meta": ((pool, other.to("meta"), 0, 1, ids, ids), "share a device"),
    }


@pytest.mark.parametrize("case", list(_bad_args()))
def test_bad_arguments_raise_value_error(case):
    args, message = _bad_args()[case]
    dst_before = args[1].clone() if args[1].device.type != "meta" else None
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        copy_kv_blocks(*args)
    if dst_before is not None:
        assert torch.equal(args[1], dst_before)


@pytest.mark.parametrize("block", [0, 3, 48])
def test_block_must_be_a_power_of_two(block):
    pool = torch.zeros(1, 2, 2, 1, 1, 4, device=DEVICE)
    ids = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="power of 2"):
        copy_kv_blocks(pool, pool.clone(), 0, 1, ids, ids, block=block)


@pytest.mark.skipif(not CUDA, reason="needs a pool over 2**31 elements (a GPU)")
def test_pool_past_int32_offsets():
    """Layer, K/V and block offsets each past 2**31 elements: computed in 64 bits."""
    shape = (16, 8, 64)
    per_block = 16 * 8 * 64
    num_blocks = 2**31 // per_block + 8  # a block id * its size alone passes 2**31
    if torch.cuda.mem_get_info()[0] < 2 * 2 * num_blocks * per_block * 2 + 2**30:
        pytest.skip("not enough free GPU memory for a 17 GB pool")
    big = torch.empty(2, 2, num_blocks, *shape, dtype=torch.bfloat16, device="cuda")
    high = torch.arange(num_blocks - 8, num_blocks, device="cuda")
    big[:, :, high] = torch.randn(2, 2, 8, *shape, device="cuda").bfloat16()
    small = torch.randn(2, 2, 10, *shape, device="cuda").bfloat16()
    low = torch.tensor([9, 0, 4, 7, 1, 2, 8, 5], device="cuda")
    expected = small.clone()
    ref_copy_kv_blocks(big, expected, 1, 2, high, low)
    copy_kv_blocks(big, small, 1, 2, high, low)  # reads far blocks of layer 1's V
    assert torch.equal(small, expected)
    copy_kv_blocks(small, big, 0, 2, low.flip(0), high)  # and writes them
    assert torch.equal(big[:, :, high], small[:, :, low.flip(0)])
    del big


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_the_kernel_writes_another_gpus_pool_directly():
    from pdserve.transport.cuda_ipc import COPY_ENGINE, KERNEL, THREE_PASSES, _peer_ways

    gen = torch.Generator().manual_seed(5)
    src = torch.randn(3, 2, 10, 4, 2, 8, generator=gen).to(torch.bfloat16).to("cuda:0")
    dst = torch.zeros(3, 2, 12, 4, 2, 8, dtype=torch.bfloat16, device="cuda:1")
    # GPU 0's kernel and its copy engine both read GPU 1's pool
    assert _peer_ways(src, dst) == [KERNEL, COPY_ENGINE, THREE_PASSES]
    src_ids = torch.tensor([7, 2, 9], device="cuda:0")
    dst_ids = torch.tensor([0, 11, 5], device="cuda:0")  # the kernel's GPU, not dst's
    copy_kv_blocks(src, dst, 1, 3, src_ids, dst_ids, peer=True)
    torch.cuda.synchronize("cuda:0")
    got, want = dst.cpu(), src.cpu()
    assert torch.equal(got[1:3][:, :, dst_ids.cpu()], want[1:3][:, :, src_ids.cpu()])
    assert not got[0].any() and not got[:, :, [1, 2, 3, 4, 6, 7, 8, 9, 10]].any()
