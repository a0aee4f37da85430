"""engine/input_batch.py's HostBlockTables: block tables kept as arrays across steps, rebuilt
whenever the block manager changes a request's blocks; pack_step packs the same bytes with or
without them, step after step, through growth, preemption and speculative roll-back."""

import random

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.input_batch import HostBlockTables, chunk_slots, pack_step
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _request(request_id: str, prompt_len: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    return Request(request_id=request_id, prompt_token_ids=list(range(5, 5 + prompt_len)),
                   sampling_params=params, eos_token_ids=frozenset({1}), max_tokens=60)


def test_rows_follow_the_block_managers_changes():
    manager, tables = BlockManager(64, 4, False), HostBlockTables()
    req = _request("a", 6)
    assert manager.allocate_slots(req, 6)
    first = tables.row(req)
    assert list(first) == req.block_ids and tables.row(req) is first  # kept while unchanged
    req.num_computed_tokens = 6
    assert manager.allocate_slots(req, 3)  # a third block
    assert list(tables.row(req)) == req.block_ids and len(req.block_ids) == 3
    manager.rollback_slots(req, 6)  # speculative drafts rejected: the tail block goes
    assert list(tables.row(req)) == req.block_ids and len(req.block_ids) == 2
    manager.free(req)
    assert list(tables.row(req)) == []
    again = _request("a", 3)  # a new request of the same id
    assert manager.allocate_slots(again, 3)
    assert list(tables.row(again)) == again.block_ids


def test_pack_step_packs_the_same_with_kept_tables():
    """Two schedulers over identical requests, one packing with HostBlockTables, one without;
    a small pool forces preemptions."""
    runs = []
    for kept in (True, False):
        manager = BlockManager(40, 4, True)
        sched = Scheduler(SchedulerConfig(max_model_len=256, max_num_seqs=8,
                                          max_num_batched_tokens=32), manager)
        gen = random.Random(1)
        for i in range(8):
            sched.add_request(_request(str(i), gen.randint(3, 20)))
        tables, packed = HostBlockTables() if kept else None, []
        for _ in range(60):
            out = sched.schedule()
            if out.is_empty:
                break
            host, order = pack_step(out, 4, None, None, tables)
            packed.append((host.longs.tobytes(), host.ints.tobytes(), host.max_blocks))
            sched.update_from_output(out, {s.request.request_id: (7, None)
                                           for s in out.scheduled if s.samples})
        runs.append((packed, sched.num_preemptions))
    assert runs[0] == runs[1]
    assert runs[0][1] > 0  # the pool was small enough to preempt


def test_chunk_slots_match_the_block_table_position_by_position():
    """A prompt chunk's slots (numpy) equal table[p // B] * B + p % B for each position, for
    chunks starting and ending inside blocks, on block edges, and of one token."""
    table, size = [7, 3, 11, 0, 5], 4
    for start, end in [(0, 20), (0, 1), (3, 4), (3, 5), (4, 8), (5, 18), (19, 20), (6, 13)]:
        want = [table[p // size] * size + p % size for p in range(start, end)]
        assert chunk_slots(table, start, end, size).tolist() == want, (start, end)


def test_mixed_step_packs_prompt_slots_then_decode_slots():
    """A step of a prompt chunk and a decode: slots hold the chunk's positions, then the
    decode's, each in its own request's blocks."""
    manager = BlockManager(16, 4, False)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4,
                                      max_num_batched_tokens=64), manager)
    sched.add_request(_request("a", 6))
    out = sched.schedule()
    sched.update_from_output(out, {"a": (7, None)})
    sched.add_request(_request("b", 9))
    out = sched.schedule()
    host, order = pack_step(out, 4)
    assert [s.request.request_id for s in order] == ["b", "a"]
    a, b = order[1].request, order[0].request
    t = host.num_tokens
    slots = list(host.longs[2 * (t + -t % 2):][:t])  # the third part: after ids and positions
    want_b = [b.block_ids[p // 4] * 4 + p % 4 for p in range(9)]
    assert slots == want_b + [a.block_ids[6 // 4] * 4 + 6 % 4]
