"""The KV data-plane layer (pdserve/transport, decode_svc/pool.py, prefill_svc/planes.py), on the
CPU in seconds.

    choose_transport, offered_transports   tables of cases, exact results
    block_runs, run_descriptors            arrays worked out by hand; for shuffled random ids the
                                           descriptors cover exactly the named blocks' bytes and
                                           a copy through them equals torch indexing
    the DataPlane contract                 one suite for every plane this machine can run (nixl
                                           over host memory here, cuda_ipc on a GPU): a spawn
                                           child owns the destination pools, registered with its
                                           own plane, and sends back their PoolInfo and bytes
    nixl faults                            descriptors outside the peer's registered pool, a
                                           closed peer, a dead peer (ConnectionError, never
                                           NIXL's own error types)
    PoolExporter                           what a decode worker publishes, planes on demand
    PeerPlanes                             the sender's choice per peer, against an in-process
                                           grpc.aio server that serves only DescribeKV

Pools are [L, 2, N, block_size, Hkv, D] = [3, 2, 10 (source) | 12 (destination), 4, 2, 8]:

    half (K or V of one block in one layer) = 4 tokens x 2 heads x 8 dims x 4 B = 256 B (fp32)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing as mp
import queue
import socket
import time
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from engine.kv_transfer import KVLayout, layout_of
from pdserve.transport.base import (
    CHOICES,
    PeerUnreachable,
    PoolInfo,
    choose_transport,
    host_id,
    offered_transports,
)
from pdserve.transport.descriptors import block_runs, run_descriptors
from pdserve.transport.nixl import nixl_module
from pdserve.transport.planes import make_plane
from protos import decode_pb2_grpc

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 4, 2, 8
SRC_BLOCKS, DST_BLOCKS = 10, 12
REPLY_S = 60.0  # the spawn child's answer (it imports torch first)

needs_nixl = pytest.mark.skipif(nixl_module() is None,
                                reason="NIXL is not installed (pip install 'pdserve[nixl]')")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _pool(num_blocks: int, dtype: str, seed: int) -> torch.Tensor:
    """Distinct random contents, the same in every process for the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# choose_transport, offered_transports

LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32",
                  block_size=BLOCK_SIZE)


def info(host: str, device: str, *offers: str) -> PoolInfo:
    """A pool on `host`'s `device` accepting `offers`, then grpc (as every pool does)."""
    return PoolInfo(pool_id=f"{host}-{device}", host_id=host, layout=LAYOUT, num_blocks=10,
                    device_type=device, transports=(*offers, "grpc"))


CUDA_H1, CPU_H1 = info("h1", "cuda"), info("h1", "cpu")

CHOOSE_CASES = [  # requested, local, peer, nixl installed here, chosen
    # auto: cuda_ipc on one host between CUDA pools, nixl only across hosts, else grpc
    ("auto", CUDA_H1, info("h1", "cuda", "cuda_ipc", "nixl"), True, "cuda_ipc"),
    ("auto", CUDA_H1, info("h1", "cuda", "nixl"), True, "grpc"),
    ("auto", CUDA_H1, info("h2", "cuda", "cuda_ipc", "nixl"), True, "nixl"),
    ("auto", CUDA_H1, info("h2", "cuda", "cuda_ipc", "nixl"), False, "grpc"),
    ("auto", CUDA_H1, info("h2", "cuda", "cuda_ipc"), True, "grpc"),
    ("auto", CPU_H1, info("h1", "cuda", "cuda_ipc"), True, "grpc"),
    ("auto", CUDA_H1, info("h1", "cpu", "cuda_ipc"), True, "grpc"),
    ("auto", CPU_H1, info("h1", "cpu", "nixl"), True, "grpc"),
    ("auto", CPU_H1, info("h2", "cpu", "nixl"), True, "nixl"),
    ("auto", CPU_H1, info("h2", "cpu"), True, "grpc"),
    # named: used when possible for the pair (nixl on one host too), else grpc
    ("cuda_ipc", CUDA_H1, info("h1", "cuda", "cuda_ipc"), False, "cuda_ipc"),
    ("cuda_ipc", CUDA_H1, info("h2", "cuda", "cuda_ipc", "nixl"), True, "grpc"),
    ("cuda_ipc", CUDA_H1, info("h1", "cuda", "nixl"), True, "grpc"),
    ("cuda_ipc", CPU_H1, info("h1", "cuda", "cuda_ipc"), True, "grpc"),
    ("nixl", CPU_H1, info("h1", "cpu", "nixl"), True, "nixl"),
    ("nixl", CUDA_H1, info("h2", "cuda", "cuda_ipc", "nixl"), True, "nixl"),
    ("nixl", CPU_H1, info("h2", "cpu", "nixl"), False, "grpc"),
    ("nixl", CPU_H1, info("h2", "cpu"), True, "grpc"),
    ("grpc", CUDA_H1, info("h1", "cuda", "cuda_ipc", "nixl"), True, "grpc"),
    ("grpc", CPU_H1, info("h2", "cpu", "nixl"), True, "grpc"),
]


def _case_id(case: tuple[str, PoolInfo, PoolInfo, bool, str]) -> str:
    requested, local, peer, nixl_here, _ = case
    offers = "+".join(peer.transports)
    return (f"{requested}:{local.device_type}@{local.host_id}->{peer.device_type}@"
            f"{peer.host_id}[{offers}]{'' if nixl_here else ':no-nixl-here'}")


@pytest.mark.parametrize("case", CHOOSE_CASES, ids=_case_id)
def test_choose_transport(case: tuple[str, PoolInfo, PoolInfo, bool, str]) -> None:
    requested, local, peer, nixl_here, chosen = case
    assert choose_transport(requested, local, peer, nixl_here) == chosen


@pytest.mark.parametrize("requested", ["rdma", "", "AUTO", "nixl "])
def test_choose_transport_refuses_an_unknown_name(requested: str) -> None:
    with pytest.raises(ValueError, match="kv transport must be one of"):
        choose_transport(requested, CPU_H1, info("h2", "cpu", "nixl"), True)


OFFERED = {  # (configured, device type, nixl installed) -> accepted, best first
    ("auto", "cpu", False): ("grpc",),
    ("auto", "cpu", True): ("nixl", "grpc"),
    ("auto", "cuda", False): ("cuda_ipc", "grpc"),
    ("auto", "cuda", True): ("cuda_ipc", "nixl", "grpc"),
    ("grpc", "cpu", False): ("grpc",),
    ("grpc", "cpu", True): ("grpc",),
    ("grpc", "cuda", False): ("grpc",),
    ("grpc", "cuda", True): ("grpc",),
    ("cuda_ipc", "cpu", False): ("grpc",),
    ("cuda_ipc", "cpu", True): ("grpc",),
    ("cuda_ipc", "cuda", False): ("cuda_ipc", "grpc"),
    ("cuda_ipc", "cuda", True): ("cuda_ipc", "grpc"),
    ("nixl", "cpu", False): ("grpc",),
    ("nixl", "cpu", True): ("nixl", "grpc"),
    ("nixl", "cuda", False): ("grpc",),
    ("nixl", "cuda", True): ("nixl", "grpc"),
}


def test_offered_transports_table_covers_every_combination() -> None:
    assert set(OFFERED) == {(c, d, n) for c in CHOICES for d in ("cpu", "cuda")
                            for n in (False, True)}


@pytest.mark.parametrize(("configured", "device", "nixl_here"), list(OFFERED),
                         ids=[f"{c}-{d}-{'nixl' if n else 'no-nixl'}" for c, d, n in OFFERED])
def test_offered_transports(configured: str, device: str, nixl_here: bool) -> None:
    assert offered_transports(configured, device, nixl_here) == OFFERED[configured, device,
                                                                        nixl_here]


@pytest.mark.parametrize("configured", ["rdma", "", "GRPC"])
def test_offered_transports_refuses_an_unknown_name(configured: str) -> None:
    with pytest.raises(ValueError, match="kv transport must be one of"):
        offered_transports(configured, "cpu", True)


def test_host_id_is_the_boot_id_and_host_name() -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert host_id() == f"{f.read().strip()}/{socket.gethostname()}"


def test_make_plane_refuses_a_name_without_a_plane() -> None:
    pool = _pool(SRC_BLOCKS, "float32", 0)
    for name in ("grpc", "auto", "rdma"):
        with pytest.raises(ValueError, match="no data plane named"):
            make_plane(name, pool, "prefill-test")


# ---------------------------------------------------------------------------------------------
# block_runs, run_descriptors


@pytest.mark.parametrize(("src", "dst", "runs"), [
    ([7, 8, 9, 2], [20, 21, 22, 5], [(7, 20, 3), (2, 5, 1)]),
    ([1, 2, 3], [5, 6, 8], [(1, 5, 2), (3, 8, 1)]),  # the destination breaks the run
    ([1, 3, 4], [5, 6, 7], [(1, 5, 1), (3, 6, 2)]),  # the source does
    ([3, 2, 1], [3, 2, 1], [(3, 3, 1), (2, 2, 1), (1, 1, 1)]),  # descending: no runs
    ([4, 4], [1, 2], [(4, 1, 1), (4, 2, 1)]),
    ([0], [11], [(0, 11, 1)]),
    (list(range(10)), list(range(2, 12)), [(0, 2, 10)]),
], ids=["two-runs", "dst-breaks", "src-breaks", "descending", "repeat", "one", "one-long-run"])
def test_block_runs(src: list[int], dst: list[int], runs: list[tuple[int, int, int]]) -> None:
    src0, dst0, lengths = block_runs(src, dst)
    assert [a.dtype for a in (src0, dst0, lengths)] == [np.int64] * 3
    assert list(zip(src0.tolist(), dst0.tolist(), lengths.tolist())) == runs


def test_block_runs_of_no_blocks_are_empty() -> None:
    for a in block_runs([], []):
        assert a.dtype == np.int64 and a.shape == (0,)


def test_block_runs_refuses_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 source blocks but 1 destination blocks"):
        block_runs([1, 2], [1])


def test_run_descriptors_by_hand() -> None:
    # base 1000, 10 blocks, half 64, layers [1, 3) = planes (layer * 2 + kv) 2, 3, 4, 5;
    # runs (start 7, 3 blocks), (start 2, 1 block): address = 1000 + (plane * 10 + start) * 64
    out = run_descriptors(1000, 10, 64, (1, 3), np.array([7, 2]), np.array([3, 1]), device_id=5)
    assert out.dtype == np.uint64
    assert out.tolist() == [
        [2728, 192, 5], [2408, 64, 5],  # layer 1 K: (20 + 7) * 64, (20 + 2) * 64
        [3368, 192, 5], [3048, 64, 5],  # layer 1 V: (30 + 7) * 64, (30 + 2) * 64
        [4008, 192, 5], [3688, 64, 5],  # layer 2 K
        [4648, 192, 5], [4328, 64, 5],  # layer 2 V
    ]


def test_run_descriptors_of_no_runs_or_no_layers_are_empty() -> None:
    none = np.zeros(0, dtype=np.int64)
    assert run_descriptors(0, 10, 64, (0, 3), none, none).shape == (0, 3)
    assert run_descriptors(0, 10, 64, (1, 1), np.array([2]), np.array([1])).shape == (0, 3)


def _block_bytes(pool: torch.Tensor, layers: tuple[int, int], ids: list[int]) -> set[int]:
    """Brute force: the byte offsets of every element of `ids` in layers [l0, l1), K and V."""
    elem = pool.element_size()
    index = torch.arange(pool.numel()).view(pool.shape)
    cells = index[layers[0]:layers[1], :, ids].reshape(-1).tolist()
    return {e * elem + b for e in cells for b in range(elem)}


def _descriptor_bytes(desc: np.ndarray) -> set[int]:
    return {a + b for a, n, _ in desc.tolist() for b in range(n)}


@pytest.mark.parametrize("seed", range(12))
def test_run_descriptors_cover_exactly_the_named_blocks(seed: int) -> None:
    """Shuffled random ids (some runs by chance, made likelier by sorting a prefix): the
    descriptors cover exactly the named blocks' bytes on each side, pair up in length, and a
    byte copy through them equals torch's indexed copy."""
    rng = np.random.default_rng(seed)
    src_pool = torch.randn(LAYERS, 2, 9, 2, 1, 3)  # half = 2 tokens x 1 head x 3 dims x 4 B
    dst_pool = torch.randn(LAYERS, 2, 11, 2, 1, 3)
    half = 2 * 1 * 3 * 4
    count = int(rng.integers(1, 9))
    src_ids = rng.permutation(9)[:count].tolist()
    dst_ids = rng.permutation(11)[:count].tolist()
    cut = int(rng.integers(0, count + 1))
    src_ids[:cut], dst_ids[:cut] = sorted(src_ids[:cut]), sorted(dst_ids[:cut])
    l0 = int(rng.integers(0, LAYERS))
    layers = (l0, int(rng.integers(l0 + 1, LAYERS + 1)))

    src0, dst0, lengths = block_runs(src_ids, dst_ids)
    local = run_descriptors(0, 9, half, layers, src0, lengths)
    remote = run_descriptors(0, 11, half, layers, dst0, lengths)

    assert _descriptor_bytes(local) == _block_bytes(src_pool, layers, src_ids)
    assert _descriptor_bytes(remote) == _block_bytes(dst_pool, layers, dst_ids)
    assert local[:, 1].tolist() == remote[:, 1].tolist()
    assert int(local[:, 1].sum()) == count * 2 * (layers[1] - layers[0]) * half

    raw_src = src_pool.view(-1).view(torch.uint8).numpy()
    raw_dst = dst_pool.clone().view(-1).view(torch.uint8).numpy()
    for (s, n, _), (d, _, _) in zip(local.tolist(), remote.tolist()):
        raw_dst[d:d + n] = raw_src[s:s + n]
    expected = dst_pool.clone()
    expected[layers[0]:layers[1], :, dst_ids] = src_pool[layers[0]:layers[1], :, src_ids]
    assert _same_bits(torch.from_numpy(raw_dst).view(torch.float32).view(dst_pool.shape),
                      expected)


# ---------------------------------------------------------------------------------------------
# The DataPlane contract: a decode worker's pools in a spawn child, written from this process


def _remote_main(name: str, device: str, commands: Any, replies: Any) -> None:
    """The spawn child: ("pool", dtype, seed) makes a destination pool of known contents,
    registered with a plane of its own, and answers its PoolInfo (one pool at a time: it
    replaces the last, whose NIXL agent would keep a progress thread spinning); ("bytes",
    pool_id) answers the pool's raw bytes; ("exit",) ends. Ends by itself when no command
    comes for a while."""
    pools: dict[str, tuple[torch.Tensor, Any]] = {}
    while True:
        command = commands.get(timeout=120)
        if command[0] == "exit":
            break
        try:
            if command[0] == "pool":
                _close_all(pools)
                replies.put(("ok", _new_pool(name, device, command[1], command[2], pools)))
            else:
                pool, _ = pools[command[1]]
                replies.put(("ok", pool.cpu().contiguous().view(-1).view(torch.uint8)
                             .numpy().tobytes()))
        except Exception as exc:  # noqa: BLE001 - sent to the test, which fails with it
            replies.put(("error", repr(exc)))
    _close_all(pools)


def _new_pool(name: str, device: str, dtype: str, seed: int,
              pools: dict[str, tuple[torch.Tensor, Any]]) -> PoolInfo:
    pool = _pool(DST_BLOCKS, dtype, seed).to(device)
    pool_id = uuid.uuid4().hex
    plane = make_plane(name, pool, f"decode-{pool_id}", serve=True)
    pools[pool_id] = (pool, plane)
    return PoolInfo(pool_id=pool_id, host_id=host_id(), layout=layout_of(list(pool.unbind(0))),
                    num_blocks=DST_BLOCKS, device_type=pool.device.type,
                    transports=(name, "grpc"), **plane.export())


def _close_all(pools: dict[str, tuple[torch.Tensor, Any]]) -> None:
    for _, plane in pools.values():
        plane.close()
    pools.clear()


class Remote:
    """The decode worker's side of a data plane, in a spawn child of its own."""

    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_remote_main, daemon=True,
                                args=(name, device, self.commands, self.replies))
        self.proc.start()

    def _ask(self, *command: Any) -> Any:
        self.commands.put(command)
        deadline = time.monotonic() + REPLY_S
        while time.monotonic() < deadline:
            try:
                status, value = self.replies.get(timeout=0.2)
            except queue.Empty:
                assert self.proc.is_alive(), f"the remote side died: {self.proc.exitcode}"
                continue
            assert status == "ok", f"the remote side failed: {value}"
            return value
        raise TimeoutError(f"the remote side did not answer {command[0]} in {REPLY_S} s")

    def new_pool(self, dtype: str, seed: int) -> PoolInfo:
        """A fresh destination pool holding `_pool(DST_BLOCKS, dtype, seed)`."""
        return self._ask("pool", dtype, seed)

    def contents(self, info: PoolInfo) -> torch.Tensor:
        raw = bytearray(self._ask("bytes", info.pool_id))
        dtype = getattr(torch, info.layout.dtype)
        shape = (LAYERS, 2, DST_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=10)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.commands.put(("exit",))
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.kill()
        for q in (self.commands, self.replies):
            q.close()
            q.cancel_join_thread()  # a dead child's unread pipe never blocks this exit
        assert not self.proc.is_alive()


@contextlib.contextmanager
def remote_side(name: str, device: str) -> Iterator[Remote]:
    remote = Remote(name, device)
    try:
        yield remote
    finally:
        remote.stop()


@pytest.fixture(scope="module", params=[
    pytest.param(("nixl", "cpu"), id="nixl", marks=needs_nixl),
    pytest.param(("cuda_ipc", "cuda"), id="cuda_ipc", marks=needs_cuda),
])
def remote(request: pytest.FixtureRequest) -> Iterator[Remote]:
    with remote_side(*request.param) as side:
        yield side


@contextlib.contextmanager
def sender(remote: Remote, dtype: str, seed: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """This process's plane over a source pool of known contents, and that pool (on the CPU)."""
    src = _pool(SRC_BLOCKS, dtype, seed)
    plane = make_plane(remote.name, src.to(remote.device), f"prefill-{uuid.uuid4().hex}")
    try:
        yield plane, src
    finally:
        plane.close()


@pytest.mark.parametrize(("dtype", "nbytes"), [("float32", 4096), ("bfloat16", 2048),
                                                ("float8_e4m3fn", 1024)])  # an fp8 KV cache
def test_write_copies_the_named_layers_of_the_named_blocks_and_nothing_else(
        remote: Remote, dtype: str, nbytes: int) -> None:
    info = remote.new_pool(dtype, seed=1)
    with sender(remote, dtype, seed=2) as (plane, src):
        peer = plane.open_peer(info)
        assert peer.transport == remote.name and peer.info == info
        # 4 blocks x 2 layers x (K, V) x 4 tokens x 2 heads x 8 dims x 4 B (fp32), 2 (bf16), 1 (fp8)
        assert plane.write(peer, (1, 3), [4, 5, 6, 0], [9, 10, 11, 2]) == nbytes
        plane.close_peer(peer)
    after = remote.contents(info)

    before = _pool(DST_BLOCKS, dtype, seed=1)
    assert not torch.equal(before[1:3, :, [9, 10, 11, 2]], src[1:3, :, [4, 5, 6, 0]])
    assert _same_bits(after[1:3, :, [9, 10, 11, 2]], src[1:3, :, [4, 5, 6, 0]])
    expected = before.clone()
    expected[1:3, :, [9, 10, 11, 2]] = src[1:3, :, [4, 5, 6, 0]]
    assert _same_bits(after, expected)  # every other block and layer: its initial bytes


def test_slabs_written_one_after_another_add_up(remote: Remote) -> None:
    """A sender's slabs: layer 0 of one long run, then layers 1-2 of it, then a lone block."""
    info = remote.new_pool("float32", seed=3)
    with sender(remote, "float32", seed=4) as (plane, src):
        peer = plane.open_peer(info)
        long_src, long_dst = list(range(10)), list(range(2, 12))
        assert plane.write(peer, (0, 1), long_src, long_dst) == 10 * 1 * 2 * 256
        assert plane.write(peer, (1, 3), long_src, long_dst) == 10 * 2 * 2 * 256
        assert plane.write(peer, (2, 3), [3], [0]) == 1 * 1 * 2 * 256
        plane.close_peer(peer)
    expected = _pool(DST_BLOCKS, "float32", seed=3)
    expected[:, :, 2:12] = src
    expected[2, :, 0] = src[2, :, 3]
    assert _same_bits(remote.contents(info), expected)


@needs_nixl
@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_nixl_staged_write_goes_as_the_destinations_runs_chunk_by_chunk(
        remote: Remote, dtype: str) -> None:
    """A shuffled source through the staging buffer (always, here; on a GPU when the source's
    order splits the runs): 1024 bytes hold one fp32 block of 2 layers (2 x 2 x 256 B), so five
    blocks go as five chunks (fp8: four, then one); the destination's blocks 5..9 are one run."""
    if remote.name != "nixl":
        pytest.skip("nixl's staging")
    from pdserve.transport.nixl import NixlPlane

    info = remote.new_pool(dtype, seed=11)
    src = _pool(SRC_BLOCKS, dtype, seed=12)
    plane = NixlPlane(src, f"prefill-{uuid.uuid4().hex}", stage="always", stage_bytes=1024)
    try:
        peer = plane.open_peer(info)
        block_bytes = 2 * 2 * 256 * src.element_size() // 4
        assert plane.write(peer, (1, 3), [7, 2, 9, 0, 4], [5, 6, 7, 8, 9]) == 5 * block_bytes
        assert plane.staging is not None  # registered on first use
        plane.close_peer(peer)
    finally:
        plane.close()
    expected = _pool(DST_BLOCKS, dtype, seed=11)
    expected[1:3, :, [5, 6, 7, 8, 9]] = src[1:3, :, [7, 2, 9, 0, 4]]
    assert _same_bits(remote.contents(info), expected)


def test_nixl_stages_only_on_a_gpu_when_the_source_splits_the_runs() -> None:
    from pdserve.transport.nixl import NixlPlane

    plane = NixlPlane.__new__(NixlPlane)  # the policy alone: no agent
    plane.stage, plane.pool = "auto", torch.empty(0)
    assert not plane._stages(runs=100, dst_ids=list(range(100)))  # CPU: never
    plane.pool = types.SimpleNamespace(device=torch.device("cuda"))
    assert plane._stages(runs=100, dst_ids=list(range(100)))  # 100 runs against 1
    assert not plane._stages(runs=3, dst_ids=[0, 1, 5, 6])  # 3 against 2
    plane.stage = "never"
    assert not plane._stages(runs=100, dst_ids=list(range(100)))
    with pytest.raises(ValueError, match="stage"):
        NixlPlane(torch.zeros(1, 2, 1, 1, 1, 1), "x", stage="sometimes")


UNREACHABLE = {  # plane -> what makes a peer's PoolInfo unopenable, besides another layout
    "nixl": {"no agent metadata": {"nixl_metadata": b""},
             "garbage agent metadata": {"nixl_metadata": b"not a NIXL agent"}},
    "cuda_ipc": {"a GPU this process does not see": {"device_uuid": "GPU-not-here"},
                 "garbage IPC handle": {"cuda_ipc_handle": b"{}"}},
}


def test_open_peer_of_an_unopenable_pool_raises_peer_unreachable(remote: Remote) -> None:
    info = remote.new_pool("float32", seed=5)
    cases = {"another head_dim": {"layout": replace(info.layout, head_dim=16)},
             "another dtype": {"layout": replace(info.layout, dtype="bfloat16")},
             **UNREACHABLE[remote.name]}
    with sender(remote, "float32", seed=6) as (plane, _):
        for case, changes in cases.items():
            with pytest.raises(PeerUnreachable):
                plane.open_peer(replace(info, **changes))
                pytest.fail(f"{case}: opened")
    assert _same_bits(remote.contents(info), _pool(DST_BLOCKS, "float32", seed=5))


# ---------------------------------------------------------------------------------------------
# nixl faults


@pytest.fixture
def nixl_remote(remote: Remote) -> Remote:
    if remote.name != "nixl":
        pytest.skip("a nixl fault")
    return remote


def test_nixl_write_outside_the_peer_pool_raises_and_writes_nothing(nixl_remote: Remote) -> None:
    """Descriptors past the end of either registered pool: NIXL refuses the whole transfer.
    (Block 12 of layer 2's V is past the 12-block pool; an out-of-range id at a lower layer
    would land inside the allocation, in another block: the plane does not check ids.)"""
    info = nixl_remote.new_pool("float32", seed=7)
    with sender(nixl_remote, "float32", seed=8) as (plane, _):
        peer = plane.open_peer(info)
        for src_ids, dst_ids in (([1, 2], [11, 12]), ([9, 10], [0, 1])):
            with pytest.raises(ConnectionError, match="could not prepare"):
                plane.write(peer, (2, 3), src_ids, dst_ids)
        with pytest.raises(ConnectionError, match="could not prepare"):
            plane.write(peer, (2, 4), [1], [1])  # a layer past the last
        plane.close_peer(peer)
    assert _same_bits(nixl_remote.contents(info), _pool(DST_BLOCKS, "float32", seed=7))


def test_nixl_write_to_a_closed_peer_raises_and_reopening_works(nixl_remote: Remote) -> None:
    info = nixl_remote.new_pool("float32", seed=9)
    with sender(nixl_remote, "float32", seed=10) as (plane, src):
        peer = plane.open_peer(info)
        plane.close_peer(peer)
        with pytest.raises(ConnectionError):
            plane.write(peer, (0, 1), [1], [1])
        plane.close_peer(peer)  # twice: never raises
        peer = plane.open_peer(info)
        assert plane.write(peer, (0, 1), [1], [1]) == 512
    expected = _pool(DST_BLOCKS, "float32", seed=9)
    expected[0, :, 1] = src[0, :, 1]
    assert _same_bits(nixl_remote.contents(info), expected)


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_write_to_a_dead_peer_raises_connection_error() -> None:
    with remote_side("nixl", "cpu") as doomed:
        info = doomed.new_pool("float32", seed=11)
        src = _pool(SRC_BLOCKS, "float32", seed=12)
        plane = make_plane("nixl", src, f"prefill-{uuid.uuid4().hex}")
        try:
            peer = plane.open_peer(info)
            connected = plane.write(peer, (0, 1), [1], [1])
            doomed.kill()
            try:
                plane.write(peer, (0, 3), [1, 2], [1, 2])
                error: BaseException | None = None
            except Exception as exc:  # noqa: BLE001 - its type is the check
                error = exc.with_traceback(None)  # no frame cycle keeping the agent alive
            plane.close_peer(peer)  # never raises
        finally:
            plane.close()
            del plane
    if connected != 512 or error is None:  # not AssertionError: the xfail is for the type
        pytest.fail(f"the first write gave {connected} B; the one to the dead peer {error!r}")
    assert isinstance(error, ConnectionError), (
        f"{type(error).__module__}.{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------
# PoolExporter: what a decode worker publishes in DescribeKV


def _exporter(configured: str, num_blocks: int = DST_BLOCKS, dtype: str = "float32") -> Any:
    from decode_svc.pool import PoolExporter

    return PoolExporter(_pool(num_blocks, dtype, seed=0), configured)


def test_exporter_configured_grpc_offers_grpc_and_starts_no_plane() -> None:
    exporter = _exporter("grpc")
    assert exporter.offered == ("grpc",)
    pool_info = exporter.describe(["nixl", "cuda_ipc"])
    assert pool_info == PoolInfo(pool_id=exporter.pool_id, host_id=host_id(), layout=LAYOUT,
                                 num_blocks=DST_BLOCKS, device_type="cpu",
                                 transports=("grpc",), push_streams=True)
    assert not exporter.accepts("nixl") and not exporter.accepts("cuda_ipc")
    exporter.close()


def test_exporters_have_distinct_pool_ids_stable_across_describes() -> None:
    first, second = _exporter("grpc"), _exporter("grpc")
    assert first.pool_id != second.pool_id
    assert first.describe([]).pool_id == first.describe(["nixl"]).pool_id == first.pool_id


@needs_nixl
@pytest.mark.parametrize("configured", ["nixl", "auto"])
def test_exporter_starts_nixl_on_the_first_describe_that_names_it(configured: str) -> None:
    exporter = _exporter(configured)
    try:
        assert exporter.offered == ("nixl", "grpc")
        quiet = exporter.describe([])
        assert quiet.transports == ("nixl", "grpc") and quiet.nixl_metadata == b""
        assert quiet.nixl_pool_address == 0
        assert not exporter.accepts("nixl")

        pool_info = exporter.describe(["nixl"])
        assert pool_info.transports == ("nixl", "grpc")
        assert pool_info.nixl_metadata != b""
        assert pool_info.nixl_pool_address == exporter.pool.data_ptr()
        assert pool_info.nixl_device_id == 0
        assert pool_info.cuda_ipc_handle == b"" and pool_info.device_uuid == ""
        assert exporter.accepts("nixl") and not exporter.accepts("cuda_ipc")
        assert exporter.describe(["nixl"]) == pool_info  # one agent, exported once
    finally:
        exporter.close()


def test_exporter_stops_offering_a_plane_that_fails_to_start(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import decode_svc.pool
    import pdserve.transport.base

    monkeypatch.setattr(pdserve.transport.base, "nixl_available", lambda: True)
    exporter = _exporter("nixl")

    def broken(name: str, pool: torch.Tensor, agent_name: str, serve: bool = False) -> Any:
        raise RuntimeError("no UCX here")

    monkeypatch.setattr(decode_svc.pool, "make_plane", broken)
    assert exporter.offered == ("nixl", "grpc")
    pool_info = exporter.describe(["nixl"])
    assert pool_info.transports == ("grpc",) and pool_info.nixl_metadata == b""
    assert not exporter.accepts("nixl")
    assert "KV transport nixl unavailable: no UCX here" in caplog.text


# ---------------------------------------------------------------------------------------------
# PeerPlanes: the sender's choice per peer, against a decode worker serving only DescribeKV


class DescribeOnly(decode_pb2_grpc.DecodeServicer):
    """A Decode servicer with DescribeKV alone: from `exporter`, or failing with `code`."""

    def __init__(self, exporter: Any = None, code: Any = None):
        self.exporter, self.code = exporter, code
        self.asked: list[list[str]] = []

    async def DescribeKV(self, request: Any, context: Any) -> Any:  # noqa: N802 - the rpc's name
        from decode_svc.convert import pool_info_to_pb

        self.asked.append(list(request.transports))
        if self.code is not None:
            await context.abort(self.code, "describe refused")
        return pool_info_to_pb(self.exporter.describe(list(request.transports)))


Serve = Callable[[DescribeOnly], Awaitable[Any]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start a grpc.aio server for a servicer; its channel."""
    import grpc

    started: list[tuple[Any, Any]] = []

    async def start(servicer: DescribeOnly) -> Any:
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, channel))
        return channel

    yield start
    for server, channel in started:
        await channel.close()
        await server.stop(None)
    started.clear()
    gc.collect()  # the servers' cycles hold the exporters: their NIXL agents' threads spin


def _planes(configured: str) -> Any:
    from prefill_svc.planes import PeerPlanes

    return PeerPlanes(_pool(SRC_BLOCKS, "float32", seed=2), configured)


async def test_peer_planes_configured_grpc_asks_nothing(serve: Serve) -> None:
    servicer = DescribeOnly(_exporter("nixl"))
    channel = await serve(servicer)
    planes = _planes("grpc")
    assert await planes.peer("decode:1", channel) is None
    assert servicer.asked == []


async def test_peer_planes_fall_back_to_grpc_for_a_worker_without_describe_kv(
        serve: Serve) -> None:
    import grpc

    servicer = DescribeOnly(code=grpc.StatusCode.UNIMPLEMENTED)
    planes = _planes("nixl")
    assert await planes.peer("decode:1", await serve(servicer)) is None
    assert len(servicer.asked) == 1


async def test_peer_planes_raise_connection_error_when_describe_kv_fails(serve: Serve) -> None:
    import grpc

    servicer = DescribeOnly(code=grpc.StatusCode.UNAVAILABLE)
    channel = await serve(servicer)
    planes = _planes("nixl")
    with pytest.raises(ConnectionError, match="DescribeKV of decode:1 failed: describe refused"):
        await planes.peer("decode:1", channel)
    with pytest.raises(ConnectionError):  # not remembered: asked again
        await planes.peer("decode:1", channel)
    assert len(servicer.asked) == 2


@needs_nixl
async def test_peer_planes_auto_on_one_host_uses_grpc_and_starts_no_plane(serve: Serve) -> None:
    """Described without exports first: grpc is chosen, so the decode side never starts its
    NIXL agent (which would hold a core)."""
    exporter = _exporter("auto")
    servicer = DescribeOnly(exporter)
    planes = _planes("auto")
    assert await planes.peer("decode:1", await serve(servicer)) is None
    assert servicer.asked == [[]]
    assert not exporter.accepts("nixl")
    exporter.close()


@needs_nixl
async def test_peer_planes_nixl_open_the_peer_once_and_write_into_its_pool(serve: Serve) -> None:
    exporter = _exporter("nixl")
    servicer = DescribeOnly(exporter)
    channel = await serve(servicer)
    planes = _planes("nixl")
    try:
        peers = await asyncio.gather(*(planes.peer("decode:1", channel) for _ in range(3)))
        assert peers[0] is not None and all(p is peers[0] for p in peers)
        assert servicer.asked == [[], ["nixl"]]  # described, then the chosen plane's export
        peer = peers[0]
        assert (peer.transport, peer.info.pool_id) == ("nixl", exporter.pool_id)

        nbytes = await asyncio.to_thread(planes.plane("nixl").write, peer, (0, 3), [1, 2], [7, 8])
        assert nbytes == 2 * 3 * 2 * 256
        expected = _pool(DST_BLOCKS, "float32", seed=0)
        expected[:, :, [7, 8]] = planes.pool[:, :, [1, 2]]
        assert _same_bits(exporter.pool, expected)

        planes.forget("decode:1")  # e.g. a push refused as stale: described again
        again = await planes.peer("decode:1", channel)
        assert again is not None and again is not peer
        assert servicer.asked == [[], ["nixl"], [], ["nixl"]]
    finally:
        planes.close()
        exporter.close()


@needs_nixl
@pytest.mark.parametrize("case", ["decode offers grpc only", "decode has another layout"])
async def test_peer_planes_nixl_fall_back_to_grpc_when_the_pair_cannot(
        serve: Serve, case: str) -> None:
    exporter = (_exporter("grpc") if case == "decode offers grpc only"
                else _exporter("nixl", dtype="bfloat16"))
    servicer = DescribeOnly(exporter)
    channel = await serve(servicer)
    planes = _planes("nixl")
    try:
        assert await planes.peer("decode:1", channel) is None
        assert await planes.peer("decode:1", channel) is None  # remembered
        # grpc only: nothing to export; another layout: nixl chosen, exported, refused here
        assert servicer.asked == ([[]] if case == "decode offers grpc only" else [[], ["nixl"]])
    finally:
        planes.close()
        exporter.close()
