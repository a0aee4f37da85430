"""The prefill side of a progressive push, without a network: which slabs go when
(prefill_svc/frontier.py, prefill_svc/push.py) and how they are read (prefill_svc/sender.py).

Layout: 4 layers, 2 kv heads x head dim 8, float32, blocks of 16 tokens:
    cell (1 layer x 1 block, K and V) = 2 x 16 x 2 x 8 x 4 B = 2048 B
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.kv_progress import KVProgress, KVWatch
from engine.kv_transfer import KVLayout, even_piece, plan_slabs
from prefill_svc.frontier import SlabFrontier
from prefill_svc.push import KVPush, SlabTicket
from prefill_svc.slab_stager import SlabStager
from protos import decode_pb2

LAYOUT = KVLayout(4, 2, 8, "float32", 16)
CELL = 2048


def drain(frontier: SlabFrontier, flush: bool) -> list[tuple[int, int, int, int]]:
    slabs = []
    while (slab := frontier.next(flush)) is not None:
        frontier.mark_sent(slab)
        slabs.append(slab)
    return slabs


@pytest.mark.parametrize("max_bytes", [1, CELL, 3 * CELL, 7 * CELL, 16 * CELL, 10**9])
def test_kv_computed_already_is_cut_like_plan_slabs(max_bytes: int) -> None:
    frontier = SlabFrontier(LAYOUT, 7, max_bytes)
    frontier.advance(4, 7)
    assert drain(frontier, flush=True) == plan_slabs(LAYOUT, 7, max_bytes)
    assert frontier.complete


def test_a_layer_too_large_for_a_slab_goes_in_even_pieces() -> None:
    """Not the largest pieces and a remainder (gRPC moved a 4/4/0.6 MiB pattern at half the
    rate of even messages): 7 blocks by at most 3 are 3, 2, 2."""
    assert [even_piece(n, m) for n, m in [(7, 3), (6, 3), (1, 3), (365, 170), (5, 0)]] == [
        3, 3, 1, 122, 1]
    frontier = SlabFrontier(LAYOUT, 7, 3 * CELL)
    frontier.advance(1, 7)
    assert drain(frontier, flush=True) == [(0, 1, 0, 3), (0, 1, 3, 5), (0, 1, 5, 7)]
    assert plan_slabs(LAYOUT, 7, 3 * CELL)[:3] == [(0, 1, 0, 3), (0, 1, 3, 5), (0, 1, 5, 7)]


def test_blocks_the_receiver_holds_are_never_sent() -> None:
    """Decode-side reuse: the first `skip_blocks` count as sent; the slabs cover the rest,
    as `read_slabs` cuts them with the same skip."""
    frontier = SlabFrontier(LAYOUT, 7, 4 * CELL, skip_blocks=5)
    frontier.advance(4, 3)  # blocks the receiver holds anyway: nothing to send
    assert drain(frontier, flush=True) == [] and not frontier.complete
    frontier.advance(4, 7)
    assert drain(frontier, flush=True) == [(0, 2, 5, 7), (2, 4, 5, 7)]
    assert frontier.complete
    assert SlabFrontier(LAYOUT, 3, CELL, skip_blocks=3).complete  # all held: only a commit
    with pytest.raises(ValueError, match="skip_blocks 4 out of range"):
        SlabFrontier(LAYOUT, 3, CELL, skip_blocks=4)


def test_full_slabs_go_as_layers_complete_the_rest_at_the_step_end() -> None:
    frontier = SlabFrontier(LAYOUT, 6, 4 * CELL)  # 4 cells a slab
    frontier.advance(1, 2)  # layer 0: blocks [0, 2) final (2 cells): could grow by a layer
    assert drain(frontier, flush=False) == []
    frontier.advance(2, 2)  # layers 0-1 x 2 blocks: full
    assert drain(frontier, flush=False) == [(0, 2, 0, 2)]
    frontier.advance(4, 2)  # the step's end
    assert drain(frontier, flush=False) == [(2, 4, 0, 2)]
    frontier.advance(1, 3)  # step 2 past layer 0: one more block, a slab of 1 cell could grow
    assert drain(frontier, flush=False) == [] and drain(frontier, flush=True) == [(0, 1, 2, 3)]
    frontier.advance(1, 6)  # 3 more cells of layer 0: twice that would not fit, so it is full
    assert drain(frontier, flush=False) == [(0, 1, 3, 6)]
    frontier.advance(4, 6)  # the prompt's end
    assert drain(frontier, flush=True) == [(1, 2, 2, 6), (2, 3, 2, 6), (3, 4, 2, 6)]
    assert frontier.complete


def test_the_rest_of_a_split_layer_does_not_hold_back_later_layers() -> None:
    frontier = SlabFrontier(LAYOUT, 5, 2 * CELL)
    frontier.advance(4, 5)
    # layer 0 in pieces of 2 blocks; its last block waits for a flush, layer 1 goes on
    assert [frontier.next(False)] == [(0, 1, 0, 2)]
    frontier.mark_sent((0, 1, 0, 2))
    frontier.mark_sent((0, 1, 2, 4))
    assert frontier.next(flush=False) == (1, 2, 0, 2)
    assert frontier.next(flush=True) == (0, 1, 4, 5)


def test_a_restart_keeps_what_was_sent() -> None:
    frontier = SlabFrontier(LAYOUT, 4, CELL)
    frontier.advance(4, 2)
    sent = drain(frontier, flush=True)
    assert len(sent) == 8
    frontier.restart()  # preempted: nothing final any more
    assert frontier.next(flush=True) is None
    frontier.advance(2, 4)  # computed again, on other blocks: only new cells go
    assert drain(frontier, flush=True) == [(0, 1, 2, 3), (0, 1, 3, 4), (1, 2, 2, 3),
                                           (1, 2, 3, 4)]


def note(layers: int, tokens: int, epoch: int = 0, total: int = 80) -> KVProgress:
    return KVProgress(layers, tokens, total, tuple(range(10, 15)), epoch)


async def test_a_push_hands_out_slabs_as_notes_come_then_ends_after_the_first_token() -> None:
    push = KVPush("r", 80, LAYOUT, 4 * CELL)  # 5 blocks
    waiting = asyncio.create_task(push.next_slab())
    push.on_progress(note(2, 32))  # layers 0-1 x blocks 0-1: 4 cells, full
    ticket = await asyncio.wait_for(waiting, 1)
    assert (ticket.slab, ticket.block_ids) == ((0, 2, 0, 2), (10, 11))
    push.sent(ticket, 4 * CELL)
    push.on_progress(note(4, 32))  # step end: flushed
    ticket = await push.next_slab()
    assert ticket.slab == (2, 4, 0, 2)
    push.sent(ticket, 4 * CELL)
    push.on_progress(note(4, 80))
    push.commit(7, None)
    slabs = []
    while (ticket := await push.next_slab()) is not None:
        slabs.append(ticket.slab)
        push.sent(ticket, 3 * CELL)
    assert slabs == [(layer, layer + 1, 2, 5) for layer in range(4)]  # 3 cells a slab
    assert push.bytes_before_first_token == 8 * CELL and push.first == (7, None)


async def test_a_preemption_makes_the_push_forget_what_was_final() -> None:
    push = KVPush("r", 80, LAYOUT, CELL)
    push.watch = KVWatch(lambda _: None)
    push.on_progress(note(4, 32))
    ticket = await push.next_slab()
    push.watch.invalidate()  # the engine preempted the request
    assert SlabStager(_caches()).encode(ticket) is None  # its blocks are not read
    push.on_progress(note(4, 48, epoch=0))  # a note already on its way: stale
    waiting = asyncio.create_task(push.next_slab())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    push.on_progress(note(4, 16, epoch=1))
    assert (await asyncio.wait_for(waiting, 1)).slab == (0, 1, 0, 1)


def _caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 20, 16, 2, 8, generator=gen) for _ in range(4)]


def test_a_slab_is_the_kvchunk_protobuf_would_make() -> None:
    caches = _caches()
    ticket = SlabTicket((1, 3, 0, 2), (17, 4), epoch=0)
    message = SlabStager(caches).encode(ticket)
    data = torch.stack([c[:, [17, 4]] for c in caches[1:3]]).numpy().tobytes()
    assert message == decode_pb2.KVChunk(data=decode_pb2.KVData(
        layer_start=1, layer_end=3, block_start=0, block_end=2, data=data)).SerializeToString()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA staging path needs a GPU")
def test_cuda_slab_waits_for_the_layers_that_wrote_it() -> None:
    """The stager gathers on its own stream after the note's event: bytes written by a long
    queue of work on the compute stream just before must be in the slab."""
    caches = [c.cuda() for c in _caches()]
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy, then write the blocks
    for c in caches:
        c[:, 17].fill_(3.0)
    ready = torch.cuda.Event()
    ready.record()
    ticket = SlabTicket((0, 4, 0, 2), (17, 4), epoch=0, ready=ready)
    message = SlabStager(caches).encode(ticket)
    data = torch.stack([c[:, [17, 4]] for c in caches]).cpu().numpy().tobytes()
    assert message == decode_pb2.KVChunk(data=decode_pb2.KVData(
        layer_start=0, layer_end=4, block_start=0, block_end=2, data=data)).SerializeToString()


def test_a_data_plane_push_within_one_slab_needs_only_the_steps_last_notes() -> None:
    """`whole_steps`: once a data plane towards the decode worker is open, a push whose KV fits
    one plane slab sends at step ends only (no full slab forms before), so the servicer watches
    it a whole step at a time; not for a worker not described yet, one pushed to over grpc, or a
    push larger than the slab. The frontier agrees: with all the layers but one final, such a
    push has nothing to send."""
    from pdserve.transport.base import Peer, PoolInfo
    from prefill_svc.planes import PeerPlanes
    from prefill_svc.sender import PushKVSender

    pool = torch.zeros(4, 2, 8, 16, 2, 8)
    planes = PeerPlanes(pool, "nixl")
    sender = PushKVSender(list(pool.unbind(0)), planes=planes, plane_slab_bytes=4 * 4 * CELL)
    assert not sender.whole_steps("decode:1", 16)  # not described yet
    planes._peers["decode:1"] = Peer(PoolInfo(pool_id="p", host_id="h", layout=LAYOUT,
                                              num_blocks=8, device_type="cpu",
                                              transports=["nixl", "grpc"]), "nixl")
    planes._peers["decode:2"] = None  # grpc
    assert sender.whole_steps("decode:1", 4 * 16)  # 4 blocks x 4 layers: one slab
    assert not sender.whole_steps("decode:1", 4 * 16 + 1)  # a fifth block: two slabs
    assert not sender.whole_steps("decode:2", 16)
    push = sender.new_push("r", 4 * 16)
    push.resize_slabs(sender.plane_slab_bytes)
    push.on_progress(KVProgress(3, 64, 64, (0, 1, 2, 3), 0))
    assert push.frontier.next(flush=False) is None
    assert PushKVSender(list(pool.unbind(0))).whole_steps("decode:1", 16) is False  # grpc only
