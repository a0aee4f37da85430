"""Runs of blocks consecutive on both sides (pdserve/transport/block_runs.py): the split that
decides one copy-engine call per run. The copy itself needs CUDA (tests/test_kv_cuda_ipc.py's
GPU run and pdserve.bench.gpu_kv_copy --peer)."""

import numpy as np
import pytest
import torch

from pdserve.transport.block_runs import copy_block_runs, runs


def test_runs_split_where_either_side_jumps():
    assert runs(np.array([4, 5, 6, 9]), np.array([0, 1, 2, 3])) == [(4, 0, 3), (9, 3, 1)]
    assert runs(np.array([0, 1, 2, 3]), np.array([7, 8, 2, 3])) == [(0, 7, 2), (2, 2, 2)]
    assert runs(np.arange(10, 20), np.arange(100, 110)) == [(10, 100, 10)]
    assert runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


def test_runs_cover_every_block_once():
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(64)[:40], np.sort(rng.permutation(64)[:40])
    pairs = [(s + i, d + i) for s, d, n in runs(src, dst) for i in range(n)]
    assert pairs == list(zip(src.tolist(), dst.tolist()))


def test_bad_ids_and_pools_are_value_errors():
    with pytest.raises(ValueError, match="1-D of one length"):
        runs(np.arange(3), np.arange(4))
    pool = torch.zeros(2, 2, 4, 16, 1, 8)
    with pytest.raises(ValueError, match="CUDA pools"):
        copy_block_runs(pool, pool.clone(), 0, 2, [(0, 1, 2)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("peer", [False, True], ids=["one_gpu", "two_gpus"])
def test_copy_block_runs_equals_the_reference(peer):
    if peer and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    src = torch.randn(3, 2, 12, 16, 2, 8, device="cuda:0").to(torch.bfloat16)
    dst = torch.zeros(3, 2, 20, 16, 2, 8, dtype=torch.bfloat16,
                      device="cuda:1" if peer else "cuda:0")
    src_ids, dst_ids = np.array([1, 2, 3, 7, 8, 0]), np.array([10, 11, 12, 13, 2, 19])
    copy_block_runs(src, dst, 1, 3, runs(src_ids, dst_ids))
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    expected = torch.zeros_like(dst)
    expected[1:3, :, dst_ids] = src[1:3, :, src_ids].to(dst.device)
    assert torch.equal(dst, expected)


def test_a_slab_takes_the_copy_engine_only_for_few_runs():
    """cuda_ipc across GPUs: the first way that passed its probe, the copy engine only while a
    slab has at most MAX_COPY_ENGINE_RUNS runs (else three passes)."""
    from pdserve.transport.base import CUDA_IPC, Peer
    from pdserve.transport.cuda_ipc import (
        COPY_ENGINE,
        KERNEL,
        MAX_COPY_ENGINE_RUNS,
        THREE_PASSES,
        CudaIpcPlane,
    )

    way = CudaIpcPlane._way
    engine_first = Peer(None, CUDA_IPC, None, {"ways": [COPY_ENGINE, THREE_PASSES]})
    assert way(engine_first, [3, 4, 5], [10, 11, 12]) == (COPY_ENGINE, [(3, 10, 3)])
    scattered = list(range(0, 2 * (MAX_COPY_ENGINE_RUNS + 1), 2))  # a run per block
    assert way(engine_first, scattered, list(range(len(scattered))))[0] == THREE_PASSES
    kernel_first = Peer(None, CUDA_IPC, None, {"ways": [KERNEL, COPY_ENGINE, THREE_PASSES]})
    assert way(kernel_first, scattered, list(range(len(scattered)))) == (KERNEL, [])
    assert way(Peer(None, CUDA_IPC, None, {"ways": [THREE_PASSES]}), [1], [2])[0] == THREE_PASSES
