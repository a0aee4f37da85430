"""The commit doorbell (pdserve/transport/doorbell.py): a data-plane push's commit as a Unix
datagram that the decode engine's thread reads between steps (decode_svc/receiver.py `ring`).

The record and the socket on their own, then a decode-role `AsyncLLMEngine` (tiny random
Llama, float32), and the same engine in a process of its own (`DecodeCoreClient`), each with a
real doorbell wired as `pdserve decode` wires it, and a receiver whose
pool offers nixl without starting a plane (these tests are about the commit, not the bytes:
the pushes send KVWritten ranges only). A ring commits the request before its commit chunk
arrives, and only for the push that is current with its stream open; the chunk then confirms
it; a push cut after its ring loses nothing. Every test ends with all blocks free.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import pytest

from decode_svc.convert import layout_to_pb
from decode_svc.core_client import DecodeCoreClient
from decode_svc.receiver import KVReceiver, PushCut
from decode_svc.server import _answer
from engine.async_engine import AsyncLLMEngine
from engine.kv_transfer import KVLayout
from pdserve import SamplingParams
from pdserve.transport.doorbell import (
    DoorbellListener,
    DoorbellSender,
    Ring,
    decode,
    encode,
)
from protos import decode_pb2

NUM_BLOCKS = 16
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
LAYOUT = KVLayout(2, 2, 16, "float32", 16)
POOL = "pool-under-test"
RUNG_TOKEN, CHUNK_TOKEN = 11, 7


def test_a_record_round_trips_and_junk_is_no_record() -> None:
    ring = Ring("req-é/1", 3, 128000, POOL)
    assert decode(encode(ring)) == ring
    for junk in (b"", b"PDKV", b"XXXX" + encode(ring)[4:], encode(ring)[:14],
                 encode(Ring("r", 1, 2, POOL)).replace(b"\0r", b"\0")):
        assert decode(junk) is None


def test_the_listener_takes_its_pools_records_and_drops_the_rest() -> None:
    listener, sender = DoorbellListener(POOL), DoorbellSender()
    try:
        assert listener.drain() == []  # never blocks
        mine, other = Ring("a", 1, 5, POOL), Ring("b", 1, 5, "another-pool")
        assert sender.ring(listener.name, mine) and sender.ring(listener.name, other)
        assert listener.drain() == [mine]
        assert not sender.ring("pdserve-kv-doorbell-nobody", mine)  # no such doorbell here
    finally:
        listener.close()
        sender.close()


def test_the_waker_calls_once_per_waiting_record_until_drained() -> None:
    listener, sender = DoorbellListener(POOL), DoorbellSender()
    woken = []
    listener.wake_on_ring(lambda: woken.append(1))
    try:
        sender.ring(listener.name, Ring("a", 1, 5, POOL))
        _until(lambda: woken == [1])
        assert listener.drain() == [Ring("a", 1, 5, POOL)]
        sender.ring(listener.name, Ring("b", 1, 5, POOL))
        _until(lambda: len(woken) == 2)
    finally:
        listener.close()
        sender.close()


def _until(ok, seconds: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class OneSidedPool:
    """The receiver's view of a pool that offers nixl: what `grant`, `target` and a data-plane
    header ask of it."""

    pool_id = POOL
    offered = ("nixl", "grpc")

    def accepts(self, transport: str) -> bool:
        return transport in self.offered


@pytest.fixture(scope="module", params=["thread", "process"])
def engine_and_bell(request: pytest.FixtureRequest,
                    tiny_llama_dir: str) -> Iterator[SimpleNamespace]:
    """The engine's loop in a thread (its thread drains the doorbell between steps), then in
    a process of its own (the doorbell's waker thread drains it and sends the commits)."""
    kwargs = {"dtype": "float32", "role": "decode", "num_kv_blocks": NUM_BLOCKS,
              "max_model_len": NUM_BLOCKS * 16, "enable_prefix_caching": False}
    bell = DoorbellListener(POOL)
    if request.param == "thread":
        engine: AsyncLLMEngine | DecodeCoreClient = AsyncLLMEngine.from_args(tiny_llama_dir,
                                                                             **kwargs)
    else:
        engine = DecodeCoreClient.from_args(tiny_llama_dir, **kwargs)
    state = SimpleNamespace(engine=engine, bell=bell, receiver=None, sender=DoorbellSender())
    if isinstance(engine, AsyncLLMEngine):
        engine.between_steps(lambda: state.receiver and _answer(bell, state.receiver))
        bell.wake_on_ring(engine.wake)
    else:
        bell.wake_on_ring(lambda: state.receiver and _answer(bell, state.receiver))
    yield state
    engine.shutdown()
    bell.close()
    state.sender.close()


@pytest.fixture
async def w(engine_and_bell: SimpleNamespace) -> AsyncIterator[SimpleNamespace]:
    """A receiver expecting request "r" (3 blocks), granted to push 1 over nixl."""
    engine = engine_and_bell.engine
    caches = {} if isinstance(engine, AsyncLLMEngine) else {
        "kv_caches": engine.kv_caches, "layout": engine.facts.layout}
    receiver = KVReceiver(engine, exporter=OneSidedPool(), write_grace_s=0.0, **caches)
    engine_and_bell.receiver = receiver
    assert await receiver.expect("r", PROMPT, PARAMS)
    assert receiver.grant("r")[2] == 1
    yield engine_and_bell
    await receiver.drop("r")
    for _ in range(100):  # a dropped one-sided request's blocks are freed after its writers
        if (await engine_and_bell.engine.stats()).num_free_blocks == NUM_BLOCKS:
            break
        await asyncio.sleep(0.02)
    assert (await engine_and_bell.engine.stats()).num_free_blocks == NUM_BLOCKS
    engine_and_bell.receiver = None


def _header(push_id: int) -> decode_pb2.KVChunk:
    return decode_pb2.KVChunk(header=decode_pb2.KVHeader(
        request_id="r", layout=layout_to_pb(LAYOUT), num_tokens=len(PROMPT), num_blocks=3,
        transport="nixl", push_id=push_id))


WRITTEN = decode_pb2.KVChunk(written=decode_pb2.KVWritten(layer_start=0, layer_end=2,
                                                           block_start=0, block_end=3))
COMMIT = decode_pb2.KVChunk(commit=decode_pb2.KVCommit(first_token_id=CHUNK_TOKEN))


def _push(push_id: int, gate: asyncio.Event, commit: bool = True
          ) -> AsyncIterator[decode_pb2.KVChunk]:
    """A data-plane push: its header, every cell written, then (once `gate` opens) its commit
    chunk, or the end of the stream without one."""
    async def chunks() -> AsyncIterator[decode_pb2.KVChunk]:
        yield _header(push_id)
        yield WRITTEN
        await gate.wait()
        if commit:
            yield COMMIT
    return chunks()


async def _polled(engine: AsyncLLMEngine | DecodeCoreClient) -> None:
    """Until the engine thread has drained its doorbell since now (its polls run before each
    round of commands: two rounds, one after the other); with an engine core process, the
    waker thread (woken by the datagram at once: 0.1 s is ample) and any commit it sent."""
    if not isinstance(engine, AsyncLLMEngine):
        await asyncio.sleep(0.1)
    await engine.stats()
    await engine.stats()


async def _tokens(engine: AsyncLLMEngine) -> list[int]:
    outs = [out async for out in engine.stream("r")]
    assert outs[-1].finished
    return list(outs[-1].outputs[0].token_ids)


async def test_a_ring_commits_the_request_before_its_commit_chunk(w) -> None:
    """The engine is idle (its thread blocks on commands): the waker wakes it, the ring
    commits, Generate's wait returns while the commit chunk is held back; the chunk then
    confirms the push without a second commit."""
    gate = asyncio.Event()
    push = asyncio.create_task(w.receiver.receive(_push(1, gate)))
    await asyncio.sleep(0.05)  # the header read
    assert w.sender.ring(w.bell.name, Ring("r", 1, RUNG_TOKEN, POOL))
    assert await asyncio.wait_for(w.receiver.wait("r", 5), 5)
    assert not push.done() and w.receiver.stats.doorbell_commits == 1
    tokens = await _tokens(w.engine)
    assert tokens[0] == RUNG_TOKEN and len(tokens) == 3
    gate.set()
    await push
    assert (w.receiver.stats.completed, w.receiver.stats.failed) == (1, 0)


async def test_a_ring_of_a_superseded_push_is_ignored(w) -> None:
    """KVTarget handed the blocks to push 2 (the gateway retried the prefill): push 1's ring
    commits nothing, push 2's commit chunk does."""
    assert (await w.receiver.target("r", POOL, "nixl"))[1] == 2
    gate = asyncio.Event()
    push = asyncio.create_task(w.receiver.receive(_push(2, gate)))
    await asyncio.sleep(0.05)
    w.sender.ring(w.bell.name, Ring("r", 1, RUNG_TOKEN, POOL))
    await _polled(w.engine)
    assert w.receiver.stats.doorbell_commits == 0 and not w.receiver.pending["r"].done.is_set()
    gate.set()
    await push
    assert await w.receiver.wait("r", 5)
    assert (await _tokens(w.engine))[0] == CHUNK_TOKEN


async def test_a_ring_before_the_push_header_was_read_is_ignored(w) -> None:
    """The ringing push's stream is not open here yet (its header not read): the ring cannot
    know the stream will end in a commit or a cut, so the stream's commit chunk commits."""
    w.sender.ring(w.bell.name, Ring("r", 1, RUNG_TOKEN, POOL))
    await _polled(w.engine)
    assert w.receiver.stats.doorbell_commits == 0
    gate = asyncio.Event()
    gate.set()
    await w.receiver.receive(_push(1, gate))
    assert await w.receiver.wait("r", 5)
    assert (await _tokens(w.engine))[0] == CHUNK_TOKEN


async def test_a_push_cut_after_its_ring_loses_nothing(w) -> None:
    """The prefill worker died between its ring and its commit chunk: the request was
    committed with every block written, so it decodes to the end; the cut fails nothing."""
    gate = asyncio.Event()
    push = asyncio.create_task(w.receiver.receive(_push(1, gate, commit=False)))
    await asyncio.sleep(0.05)
    w.sender.ring(w.bell.name, Ring("r", 1, RUNG_TOKEN, POOL))
    assert await asyncio.wait_for(w.receiver.wait("r", 5), 5)
    gate.set()
    with pytest.raises(PushCut):
        await push
    assert (w.receiver.stats.cut, w.receiver.stats.failed) == (0, 0)
    tokens = await _tokens(w.engine)
    assert tokens[0] == RUNG_TOKEN and len(tokens) == 3


async def test_a_ring_after_its_push_was_cut_is_ignored(w) -> None:
    """The push's stream broke before its ring came: the blocks wait for the retried prefill
    as without a doorbell, and its push (KVTarget: push 2) commits them."""
    gate = asyncio.Event()
    gate.set()
    with pytest.raises(PushCut):
        await w.receiver.receive(_push(1, gate, commit=False))
    w.sender.ring(w.bell.name, Ring("r", 1, RUNG_TOKEN, POOL))
    await _polled(w.engine)
    assert w.receiver.stats.doorbell_commits == 0 and not w.receiver.pending["r"].done.is_set()
    assert (await w.receiver.target("r", POOL, "nixl"))[1] == 2
    await w.receiver.receive(_push(2, gate))
    assert await w.receiver.wait("r", 5)
    assert (await _tokens(w.engine))[0] == CHUNK_TOKEN


async def test_a_ring_after_the_commit_chunk_is_ignored(w) -> None:
    gate = asyncio.Event()
    gate.set()
    await w.receiver.receive(_push(1, gate))
    w.sender.ring(w.bell.name, Ring("r", 1, RUNG_TOKEN, POOL))
    await _polled(w.engine)
    assert w.receiver.stats.doorbell_commits == 0
    assert await w.receiver.wait("r", 5)
    tokens = await _tokens(w.engine)
    assert tokens[0] == CHUNK_TOKEN and len(tokens) == 3
