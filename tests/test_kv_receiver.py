"""The decode side of a progressive push (decode_svc/receiver.py): a header, slabs in any order
written as they come, then a commit carrying the first token, last. Anything else fails the
transfer, frees the reserved blocks and fails the waiting Generate with the same reason; a push
that stops short leaves the blocks reserved for the next one.

One decode-role `AsyncLLMEngine` (tiny random Llama: 2 layers, float32, 16 blocks of 16 tokens)
serves the module; a request of 40 tokens reserves 3 blocks, so a push covers 2 x 3 cells of
4096 bytes each. Every test ends with all 16 blocks free.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from decode_svc.convert import layout_to_pb
from decode_svc.receiver import KVReceiver, PushCut, TransferFailed
from engine.async_engine import AsyncLLMEngine
from engine.kv_transfer import KVLayout
from pdserve import SamplingParams
from protos import decode_pb2

NUM_BLOCKS = 16
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
CELL = 2 * 16 * 2 * 16 * 4  # (K, V) x tokens x kv heads x head dim x 4 B
CELLS = [(layer, block) for layer in range(2) for block in range(3)]
LAYOUT = KVLayout(2, 2, 16, "float32", 16)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> Iterator[AsyncLLMEngine]:
    """Without prefix caching: every test's reservation of PROMPT gets the whole push."""
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", role="decode",
                                      num_kv_blocks=NUM_BLOCKS, max_model_len=NUM_BLOCKS * 16,
                                      enable_prefix_caching=False)
    yield engine
    engine.shutdown()


@pytest.fixture
async def receiver(engine: AsyncLLMEngine) -> AsyncIterator[KVReceiver]:
    """A receiver expecting request "r" (3 blocks reserved); all blocks free afterwards."""
    receiver = KVReceiver(engine)
    assert await receiver.expect("r", PROMPT, PARAMS)
    yield receiver
    await receiver.drop("r")
    assert (await engine.stats()).num_free_blocks == NUM_BLOCKS


def header(num_blocks: int = 3, skip: int = 0, request_id: str = "r") -> decode_pb2.KVChunk:
    return decode_pb2.KVChunk(header=decode_pb2.KVHeader(
        request_id=request_id, layout=layout_to_pb(LAYOUT), num_tokens=len(PROMPT),
        num_blocks=num_blocks, skip_blocks=skip))


def slab(l0: int, l1: int, b0: int, b1: int, nbytes: int | None = None,
         fill: int | None = None) -> decode_pb2.KVChunk:
    """Slab of layers [l0, l1) x blocks [b0, b1), every byte `fill` (default: l0 + 1)."""
    size = (l1 - l0) * (b1 - b0) * CELL if nbytes is None else nbytes
    data = bytes([l0 + 1 if fill is None else fill]) * size
    return decode_pb2.KVChunk(data=decode_pb2.KVData(
        layer_start=l0, layer_end=l1, block_start=b0, block_end=b1, data=data))


def cells(order: list[tuple[int, int]]) -> list[decode_pb2.KVChunk]:
    return [slab(layer, layer + 1, block, block + 1) for layer, block in order]


COMMIT = decode_pb2.KVChunk(commit=decode_pb2.KVCommit(first_token_id=7))


async def stream(*chunks: decode_pb2.KVChunk) -> AsyncIterator[decode_pb2.KVChunk]:
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk


async def test_slabs_in_any_order_then_the_commit_start_the_request(engine, receiver) -> None:
    order = list(CELLS)
    random.Random(3).shuffle(order)
    assert order != CELLS
    blocks = receiver.pending["r"].block_ids
    received = await receiver.receive(stream(header(), *cells(order), COMMIT))
    assert received == 6 * CELL
    kv = engine.engine.runner.kv_caches
    for layer in range(2):  # each layer's slabs hold bytes of layer + 1 (blocks 0, 1: prompt)
        assert set(kv[layer][:, blocks[:2]].reshape(-1).view(torch.uint8).tolist()) == {layer + 1}
    assert await receiver.wait("r", 5)
    outs = [out async for out in engine.stream("r")]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3  # 7, then 2 decoded
    assert receiver.stats.completed == 1 and receiver.stats.first_slab_to_commit_seconds > 0


async def test_each_slab_lands_in_the_cache_as_it_arrives(engine, receiver) -> None:
    """The cache holds the first slab while the push still waits for its sender."""
    blocks = receiver.pending["r"].block_ids
    gate = asyncio.Event()

    async def chunks() -> AsyncIterator[decode_pb2.KVChunk]:
        yield header()
        yield slab(0, 2, 0, 2)
        await gate.wait()
        yield slab(0, 2, 2, 3)
        yield COMMIT

    task = asyncio.create_task(receiver.receive(chunks()))
    await asyncio.sleep(0.2)
    kv = engine.engine.runner.kv_caches
    first = kv[0][:, blocks[:2]].reshape(-1).view(torch.uint8)
    assert set(first.tolist()) == {1} and not task.done()
    gate.set()
    assert await task == 6 * CELL
    assert await receiver.wait("r", 5)
    await engine.abort("r")


BAD = {
    "commit before every cell": (
        [header(), *cells(CELLS[:-1]), COMMIT], "KV commit before every layer and block arrived"),
    "slab sent twice": (
        [header(), *cells(CELLS), slab(1, 2, 2, 3), COMMIT],
        "KV slab layers [1, 2) x blocks [2, 3) overlaps another"),
    "slab out of range": (
        [header(), slab(0, 1, 3, 4)], "KV slab range layers [0, 1) x blocks [3, 4) is invalid"),
    "slab one byte short": (
        [header(), slab(0, 2, 0, 3, 6 * CELL - 1)], f"KV slab holds {6 * CELL - 1} bytes, "
                                                    f"expected {6 * CELL}"),
    "slab before the header": ([slab(0, 1, 0, 1)], "a KV stream must start with a KVHeader"),
    "a chunk after the commit": (
        [header(), *cells(CELLS), COMMIT, slab(0, 1, 0, 1)], "a KV stream ends with its commit"),
    "a second header": (
        [header(), slab(0, 1, 0, 1), header()],
        "a KV stream carries one header, then data chunks and a commit"),
    "wrong block count": ([header(2)], "header announces 2 blocks, 3 reserved"),
    "skips blocks not held here": (
        [header(skip=1)], "header skips 1 blocks, this worker holds the first 0 (Generate's "
                          "cached_blocks)"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_bad_push_fails_and_frees_the_blocks(engine, receiver, case: str) -> None:
    chunks, message = BAD[case]
    with pytest.raises(ValueError) as info:
        await receiver.receive(stream(*chunks))
    assert str(info.value) == message
    if case == "slab before the header":  # not attributable to a request: "r" still waits
        assert (await engine.stats()).num_free_blocks == NUM_BLOCKS - 3
        return
    assert (await engine.stats()).num_free_blocks == NUM_BLOCKS
    with pytest.raises(TransferFailed) as failed:
        await receiver.wait("r", 5)
    assert str(failed.value) == f"KV transfer failed: {message}"
    assert receiver.stats.failed == 1


CUT = {
    "cancelled": None,
    "no commit": ([header(), *cells(CELLS)], "KV stream ended without its commit"),
    "cut off": ([header(), *cells(CELLS[:2])],
                "KV stream ended before every layer and block arrived"),
}


@pytest.mark.parametrize("case", list(CUT))
async def test_a_push_cut_off_keeps_the_blocks_for_the_next_push(engine, receiver,
                                                                 case: str) -> None:
    """A sender that stops before its commit (cancelled: its request ended at the first token,
    or it died; or its stream just ended) fails nothing here: the blocks stay reserved and a
    second push (the prefill the gateway retried elsewhere) fills and commits them."""
    if CUT[case] is None:
        gate = asyncio.Event()

        async def chunks() -> AsyncIterator[decode_pb2.KVChunk]:
            yield header()
            yield slab(0, 1, 0, 3)
            await gate.wait()

        task = asyncio.create_task(receiver.receive(chunks()))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        chunks, message = CUT[case]
        with pytest.raises(PushCut, match=f"^{message}$"):
            await receiver.receive(stream(*chunks))
    assert (await engine.stats()).num_free_blocks == NUM_BLOCKS - 3
    assert (receiver.stats.cut, receiver.stats.failed) == (1, 0)
    order = list(CELLS)
    random.Random(5).shuffle(order)
    assert await receiver.receive(stream(header(), *cells(order), COMMIT)) == 6 * CELL
    assert await receiver.wait("r", 5)
    await engine.abort("r")


async def test_a_cut_push_nobody_replaces_times_out_and_frees_the_blocks(engine,
                                                                         receiver) -> None:
    with pytest.raises(PushCut):
        await receiver.receive(stream(header(), *cells(CELLS[:2])))
    with pytest.raises(TimeoutError, match="nothing came for 0.3 s"):
        await receiver.wait("r", 0.3)
    assert (await engine.stats()).num_free_blocks == NUM_BLOCKS


async def test_a_newer_push_takes_over_from_one_still_open(engine, receiver) -> None:
    """The retried prefill's push may arrive while the lost worker's push still looks open (its
    connection has not failed yet): the newer push fills and commits the blocks, and the older
    one writes nothing more and ends cut off, failing nothing."""
    blocks = receiver.pending["r"].block_ids
    gate = asyncio.Event()

    async def stale() -> AsyncIterator[decode_pb2.KVChunk]:
        yield header()
        yield slab(0, 1, 0, 3, fill=0xEE)
        await gate.wait()
        yield slab(1, 2, 0, 3, fill=0xEE)
        yield COMMIT

    old = asyncio.create_task(receiver.receive(stale()))
    await asyncio.sleep(0.1)
    assert await receiver.receive(stream(header(), *cells(CELLS), COMMIT)) == 6 * CELL
    gate.set()
    with pytest.raises(PushCut, match="a newer push of the request took over its blocks"):
        await old
    kv = engine.engine.runner.kv_caches
    for layer in range(2):
        assert set(kv[layer][:, blocks[:2]].reshape(-1).view(torch.uint8).tolist()) == {layer + 1}
    assert (receiver.stats.cut, receiver.stats.failed, receiver.stats.completed) == (1, 0, 1)
    assert await receiver.wait("r", 5)
    outs = [out async for out in engine.stream("r")]
    assert outs[-1].finished and outs[-1].outputs[0].token_ids[0] == 7


async def test_a_push_skips_the_blocks_the_prefix_cache_holds(tiny_llama_dir: str) -> None:
    """Decode-side reuse: a request whose first blocks this worker's prefix cache holds (an
    earlier request's prompt) reserves them shared; its push carries only the rest, and a
    slab over a held block is refused before anything is written into it."""
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", role="decode",
                                      num_kv_blocks=NUM_BLOCKS, max_model_len=NUM_BLOCKS * 16)
    try:
        receiver = KVReceiver(engine)
        assert await receiver.expect("a", PROMPT, PARAMS) and receiver.cached_blocks("a") == 0
        await receiver.receive(stream(header(request_id="a"), *cells(CELLS), COMMIT))
        assert await receiver.wait("a", 5)
        assert [out async for out in engine.stream("a")][-1].finished
        kv = engine.engine.runner.kv_caches
        held = [kv[layer][:, :].clone() for layer in range(2)]
        assert await receiver.expect("b", PROMPT, PARAMS)
        assert receiver.cached_blocks("b") == 2  # 40 tokens: blocks 0, 1 are full and cached
        bad = header(request_id="b", skip=2), slab(0, 1, 1, 3)
        with pytest.raises(ValueError, match="overlaps another"):
            await receiver.receive(stream(*bad))
        assert all(torch.equal(kv[layer], held[layer]) for layer in range(2))
        assert (await engine.stats()).num_free_blocks == NUM_BLOCKS  # "b" failed, freed

        assert await receiver.expect("c", PROMPT, PARAMS) and receiver.cached_blocks("c") == 2
        rest = [slab(layer, layer + 1, 2, 3) for layer in range(2)]
        got = await receiver.receive(stream(header(request_id="c", skip=2), *rest, COMMIT))
        assert got == 2 * CELL and receiver.stats.skipped_blocks == 2
        assert await receiver.wait("c", 5)
        outs = [out async for out in engine.stream("c")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        assert (await engine.stats()).num_free_blocks == NUM_BLOCKS
    finally:
        engine.shutdown()
