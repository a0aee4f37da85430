"""Scheduler: exactly what runs each step under budgets, seats and blocks."""

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 16


def make(num_blocks=64, budget=64, seats=8, chunked=True, prefix=True, max_len=512):
    cfg = SchedulerConfig(
        max_model_len=max_len, max_num_seqs=seats, max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(cfg, BlockManager(num_blocks, BS, prefix))


def req(rid, n_prompt, max_tokens=100, first_token=0, **params):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(rid, list(range(first_token, first_token + n_prompt)), sp, max_tokens=max_tokens)


def plan(out):
    return [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled]


def step(sched, token=5):
    out = sched.schedule()
    samples = {s.request.request_id: (token, None) for s in out.scheduled if s.samples}
    finished = sched.update_from_output(out, samples)
    return out, finished


def test_chunked_prefill_shares_budget_with_later_requests():
    s = make(budget=32)
    s.add_request(req("a", 50))
    s.add_request(req("b", 10, first_token=1000))
    out, _ = step(s)
    assert plan(out) == [("a", 32, False)]
    out, _ = step(s)
    assert plan(out) == [("a", 18, True), ("b", 10, True)]
    out, _ = step(s)
    assert plan(out) == [("a", 1, True), ("b", 1, True)]
    a = s.running[0]
    assert a.num_computed_tokens == 51 and a.output_token_ids == [5, 5]


def test_no_chunking_waits_for_whole_prompt_budget():
    s = make(budget=64, chunked=False, max_len=64)
    s.add_request(req("a", 40))
    s.add_request(req("b", 30, first_token=500))
    out, _ = step(s)
    assert plan(out) == [("a", 40, True)]  # b (30) does not fit the 24 left
    out, _ = step(s)
    assert plan(out) == [("a", 1, True), ("b", 30, True)]


def test_max_num_seqs_caps_running():
    s = make(seats=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, first_token=100 * i))
    out, _ = step(s)
    assert [p[0] for p in plan(out)] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_finish_on_max_tokens_frees_blocks():
    s = make(num_blocks=8)
    s.add_request(req("a", 20, max_tokens=2))
    _, fin = step(s)
    assert fin == []
    _, fin = step(s)
    assert [r.request_id for r in fin] == ["a"]
    assert fin[0].status == RequestStatus.FINISHED_LENGTH
    assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished()


def test_preemption_takes_latest_admitted_and_recomputes():
    # 4 blocks of 16: a and b hold two each, and both need a third at the same step.
    s = make(num_blocks=4, budget=64, prefix=False)
    s.add_request(req("a", 31))
    s.add_request(req("b", 31, first_token=100))
    out, _ = step(s)
    assert plan(out) == [("a", 31, True), ("b", 31, True)]
    out, _ = step(s)  # both at 32 tokens: still 2 blocks each
    assert plan(out) == [("a", 1, True), ("b", 1, True)]
    out, _ = step(s)  # both need a third block: none free -> b preempted, a continues
    assert plan(out) == [("a", 1, True)]
    b = out.preempted[0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.num_preemptions == 1 and list(s.waiting) == [b]
    assert b.output_token_ids == [5, 5]  # kept: recomputed as part of the prompt later
    s.finish(s.running[0], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert plan(out) == [("b", 33, True)]  # prompt 31 + 2 outputs recomputed, samples a 3rd


def test_waiting_not_admitted_in_a_step_that_preempts():
    s = make(num_blocks=4, budget=64)
    s.add_request(req("a", 31))
    s.add_request(req("b", 31, first_token=100))
    step(s)
    step(s)
    s.add_request(req("c", 3, first_token=300))
    out, _ = step(s)
    assert out.preempted and "c" not in [p[0] for p in plan(out)]


def test_prefix_hit_skips_cached_tokens():
    s = make()
    s.add_request(req("a", 40, max_tokens=1))
    step(s)
    s.add_request(req("b", 40, max_tokens=1))
    out, _ = step(s)
    assert plan(out) == [("b", 8, True)]
    assert out.scheduled[0].request.num_cached_tokens == 32


def test_siblings_wait_for_leader_prompt_then_share_its_blocks():
    s = make(budget=32)
    sp = dict(n=3, seed=1, temperature=1.0)
    kids = [req(f"p-{i}", 40, **sp) for i in range(3)]
    for i, k in enumerate(kids):
        k.parent_id, k.index = "p", i
        s.add_request(k)
    out, _ = step(s)
    assert plan(out) == [("p-0", 32, False)]  # siblings held back while p-0 computes
    out, _ = step(s)
    assert plan(out) == [("p-0", 8, True)]
    assert [r.request_id for r in s.waiting] == ["p-1", "p-2"]
    out, _ = step(s)
    assert plan(out) == [("p-0", 1, True), ("p-1", 8, True), ("p-2", 8, True)]
    leader = kids[0]
    assert kids[1].block_ids[:2] == leader.block_ids[:2] == kids[2].block_ids[:2]
    assert s.block_manager.blocks[leader.block_ids[0]].ref_count == 3
    assert len({k.block_ids[2] for k in kids}) == 3  # each its own tail block


def test_abort_waiting_and_running():
    s = make(num_blocks=8)
    s.add_request(req("a", 20))
    s.add_request(req("b", 20, first_token=50))
    s.add_request(req("c", 20, first_token=90))
    step(s)
    a, b = s.running[0], s.running[1]
    c = s.waiting[0] if s.waiting else s.running[2]
    for r in (a, c):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in s.running] == ["b"]
    assert not s.waiting
    assert s.block_manager.num_free_blocks == 8 - len(b.block_ids)


# ---- decode role: reservations wait for free blocks, first come first served -----------------
def test_reservations_wait_for_blocks_first_come_first_served():
    s = make(num_blocks=8)
    holder, big, small = req("holder", 5 * BS), req("big", 4 * BS), req("small", BS)
    assert s.reserve(holder, queue=True) and holder.block_ids == [0, 1, 2, 3, 4]
    assert not s.reserve(big, queue=True)  # 3 blocks free, 4 needed
    assert not s.reserve(small, queue=True)  # 1 would fit, but big came first
    assert [r.status for r in (big, small)] == [RequestStatus.WAITING_FOR_BLOCKS] * 2
    assert big.block_ids == small.block_ids == []
    assert s.grant_reservations() == []
    st = s.stats()
    assert (st.num_waiting, st.num_waiting_for_blocks, st.num_free_blocks) == (3, 2, 3)
    s.finish(holder, RequestStatus.FINISHED_ABORTED)
    assert s.grant_reservations() == [big, small]
    assert big.block_ids == [0, 1, 2, 3] and small.block_ids == [4]
    assert [r.status for r in (big, small)] == [RequestStatus.WAITING_FOR_KV] * 2
    st = s.stats()
    assert (st.num_waiting, st.num_waiting_for_blocks, st.num_free_blocks) == (2, 0, 3)


def test_a_reservation_that_may_not_queue_changes_nothing():
    s = make(num_blocks=4)
    assert s.reserve(req("holder", 3 * BS))
    late = req("late", 2 * BS)
    assert not s.reserve(late)
    assert late.status == RequestStatus.WAITING and not s.awaiting_blocks
    assert s.stats().num_waiting == 1


def test_aborting_a_waiting_reservation_takes_it_out_of_line():
    s = make(num_blocks=4)
    holder, first, second = req("holder", 4 * BS), req("first", 2 * BS), req("second", BS)
    assert s.reserve(holder)
    assert not s.reserve(first, queue=True) and not s.reserve(second, queue=True)
    s.finish(first, RequestStatus.FINISHED_ABORTED)
    assert list(s.awaiting_blocks) == [second] and s.block_manager.num_free_blocks == 0
    s.finish(holder, RequestStatus.FINISHED_ABORTED)
    assert s.grant_reservations() == [second] and s.block_manager.num_free_blocks == 3


def test_a_reservation_bigger_than_the_whole_cache_is_refused_not_queued():
    s = make(num_blocks=4)
    huge = req("huge", 4 * BS + 1)
    with pytest.raises(ValueError, match="needs 5 KV blocks .* whole cache holds \\(4\\)"):
        s.reserve(huge, queue=True)
    assert huge.status == RequestStatus.WAITING and not s.awaiting_blocks
    assert s.block_manager.num_free_blocks == 4
