"""A decode worker whose KV cache is full queues reservations instead of refusing them.

One decode-role `AsyncLLMEngine` (tiny random Llama, 32 blocks of 16 tokens = 512 tokens, its
max_model_len) serves the module, then a `DecodeCoreClient` (the same engine in a process of its
own). A "holder" reserves 30 blocks, leaving 2 free; the requests
under test need more than that and wait until the holder frees its blocks (finished or aborted),
first come first served, or give up. Every test ends with all 32 blocks free and no waiter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from decode_svc.core_client import CorePoolExporter, DecodeCoreClient
from decode_svc.receiver import KVReceiver
from engine.async_engine import AsyncLLMEngine
from engine.config import KVWaitConfig
from engine.kv_handoff import KVCacheFullError
from pdserve import SamplingParams
from pdserve.cluster.grpc_server import NotFoundError
from protos import decode_pb2

BS = 16
NUM_BLOCKS = 32
WAIT = KVWaitConfig(seconds=10.0, max_requests=4)
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def prompt(num_blocks: int, first: int = 10) -> list[int]:
    return list(range(first, first + num_blocks * BS))


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request: pytest.FixtureRequest, tiny_llama_dir: str) -> Iterator[AsyncLLMEngine]:
    """The engine's step loop in a thread of this process, then in a process of its own
    (`DecodeCoreClient`: the queue and its grants live there)."""
    engine_class = AsyncLLMEngine if request.param == "thread" else DecodeCoreClient
    engine = engine_class.from_args(tiny_llama_dir, dtype="float32", role="decode",
                                    num_kv_blocks=NUM_BLOCKS, block_size=BS,
                                    max_model_len=NUM_BLOCKS * BS)
    yield engine
    engine.shutdown()


def make_receiver(engine: AsyncLLMEngine | DecodeCoreClient) -> KVReceiver:
    if isinstance(engine, AsyncLLMEngine):
        return KVReceiver(engine, WAIT)
    exporter = CorePoolExporter(engine)
    return KVReceiver(engine, WAIT, exporter, kv_caches=engine.kv_caches,
                      layout=exporter.layout)


@pytest.fixture
async def holder(engine: AsyncLLMEngine) -> AsyncIterator[str]:
    """30 of the 32 blocks reserved by request "holder"; all free again afterwards."""
    assert await engine.reserve_remote("holder", prompt(30), PARAMS, wait=WAIT) is not None
    yield "holder"
    await engine.abort("holder")
    stats = await engine.stats()
    assert (stats.num_free_blocks, stats.num_waiting, stats.num_running) == (NUM_BLOCKS, 0, 0)


async def load(engine: AsyncLLMEngine) -> tuple[int, int, int]:
    """(num_waiting, num_waiting_for_blocks, num_free_blocks)."""
    s = await engine.stats()
    return s.num_waiting, s.num_waiting_for_blocks, s.num_free_blocks


async def settle() -> None:
    """Long enough for a queued command to reach the engine thread and its answer to come back."""
    await asyncio.sleep(0.2)


def reserve(engine: AsyncLLMEngine, request_id: str, num_blocks: int,
            wait: KVWaitConfig = WAIT) -> asyncio.Task:
    return asyncio.create_task(
        engine.reserve_remote(request_id, prompt(num_blocks, 20), PARAMS, wait=wait))


async def test_a_reservation_waits_until_a_finished_request_frees_its_blocks(engine, holder):
    waiter = reserve(engine, "w", 4)
    await settle()
    assert not waiter.done()
    assert await load(engine) == (2, 1, 2)  # holder reserved + w waiting; 2 blocks free
    await engine.commit_remote(holder, 7, None)  # the holder's KV "arrived": it decodes
    outs = [out async for out in engine.stream(holder)]
    assert outs[-1].finished  # max_tokens=2: its blocks are freed by that step
    blocks = await asyncio.wait_for(waiter, 5)
    assert len(blocks.block_ids) == 4
    assert await load(engine) == (1, 0, NUM_BLOCKS - 4)
    assert await engine.abort("w")


async def test_waiters_are_granted_in_arrival_order_and_a_big_one_is_not_overtaken(
    engine, holder
):
    granted: list[str] = []
    big = reserve(engine, "big", 20)
    await settle()
    small = reserve(engine, "small", 1)  # 2 blocks are free, but big came first
    big.add_done_callback(lambda _: granted.append("big"))
    small.add_done_callback(lambda _: granted.append("small"))
    await settle()
    assert not small.done() and await load(engine) == (3, 2, 2)
    await engine.abort(holder)
    assert len((await asyncio.wait_for(big, 5)).block_ids) == 20
    assert len((await asyncio.wait_for(small, 5)).block_ids) == 1
    assert granted == ["big", "small"]
    assert await load(engine) == (2, 0, NUM_BLOCKS - 21)
    assert await engine.abort("big") and await engine.abort("small")


async def test_a_reservation_not_granted_in_time_fails_and_keeps_nothing(engine, holder):
    with pytest.raises(KVCacheFullError, match="not free within 0.3 s"):
        await reserve(engine, "late", 4, KVWaitConfig(seconds=0.3, max_requests=4))
    assert await load(engine) == (1, 0, 2)
    await engine.abort(holder)
    await settle()
    assert await load(engine) == (0, 0, NUM_BLOCKS)  # nothing was granted to "late" after all
    assert not await engine.abort("late")


async def test_a_cancelled_waiter_leaves_the_queue_with_nothing_reserved(engine, holder):
    waiter = reserve(engine, "gone", 4)
    await settle()
    waiter.cancel()  # e.g. the Generate call was cancelled: the client went away
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await settle()
    assert await load(engine) == (1, 0, 2)
    await engine.abort(holder)
    await settle()
    assert await load(engine) == (0, 0, NUM_BLOCKS)


async def test_aborting_a_waiter_ends_its_wait_with_nothing_reserved(engine, holder):
    waiter = reserve(engine, "aborted", 4)
    await settle()
    assert await engine.abort("aborted")  # the Abort rpc, or a cancellation through Redis
    assert await asyncio.wait_for(waiter, 5) is None
    assert await load(engine) == (1, 0, 2)


async def test_past_max_requests_waiting_a_reservation_fails_at_once(engine, holder):
    one = KVWaitConfig(seconds=10.0, max_requests=1)
    first = reserve(engine, "first", 4, one)
    await settle()
    with pytest.raises(KVCacheFullError, match="1 requests already waiting for blocks"):
        await asyncio.wait_for(reserve(engine, "second", 1, one), 1)
    assert await load(engine) == (2, 1, 2)
    assert await engine.abort("first") and await asyncio.wait_for(first, 5) is None


async def test_without_a_wait_a_full_cache_fails_at_once(engine, holder):
    with pytest.raises(KVCacheFullError, match="2 KV blocks free"):
        await asyncio.wait_for(reserve(engine, "now", 4, KVWaitConfig()), 1)
    assert await load(engine) == (1, 0, 2)


async def test_a_request_bigger_than_the_whole_cache_is_refused_at_once(engine, holder):
    # The cache holds max_model_len tokens, so the context-length check refuses it first.
    with pytest.raises(ValueError, match="longer than the model's context"):
        await asyncio.wait_for(reserve(engine, "huge", NUM_BLOCKS + 1), 1)
    assert await load(engine) == (1, 0, 2)


# ---- the decode service's receiver on top ------------------------------------------------------
async def test_a_request_dropped_while_waiting_for_blocks_is_not_expected(engine, holder):
    receiver = make_receiver(engine)
    expecting = asyncio.create_task(receiver.expect("r", prompt(4, 20), PARAMS))
    await settle()
    with pytest.raises(NotFoundError):  # no push before the blocks are reserved
        await receiver.receive(_chunks(decode_pb2.KVChunk(
            header=decode_pb2.KVHeader(request_id="r", num_blocks=4))))
    assert await receiver.drop("r")
    assert await asyncio.wait_for(expecting, 5) is False
    assert "r" not in receiver.pending and await load(engine) == (1, 0, 2)


async def test_the_receiver_expects_a_request_once_its_blocks_are_granted(engine, holder):
    receiver = make_receiver(engine)
    expecting = asyncio.create_task(receiver.expect("r", prompt(4, 20), PARAMS))
    await settle()
    await engine.abort(holder)
    assert await asyncio.wait_for(expecting, 5) is True
    assert len(receiver.pending["r"].block_ids or []) == 4
    assert await receiver.drop("r")


async def _chunks(*chunks: decode_pb2.KVChunk) -> AsyncIterator[decode_pb2.KVChunk]:
    for chunk in chunks:
        yield chunk
