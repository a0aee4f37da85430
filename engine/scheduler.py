"""Continuous batching at iteration level: which requests run this step, and how many tokens each.

Torch-free: inputs are the request queues and the block manager; the output is a plain
`SchedulerOutput` the model runner consumes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.scheduler_output import (
    Sample,
    Samples,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodeCounts,
)
from engine.spec_decode import policy as spec_policy
from engine.stop_checker import check_token_stop


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, hold_finished: bool = False
    ):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._leaders: dict[str, Request] = {}  # parent_id -> index-0 sibling, for n > 1
        # Prefill role: requests finished by a token keep their blocks (to be exported) until
        # `release`. Decode role: requests whose KV is being imported hold reserved blocks.
        self.hold_finished = hold_finished
        self.held: dict[str, Request] = {}
        self.reserved: dict[str, Request] = {}
        # Decode role: reservations waiting, first come first served, for their blocks to free up.
        self.awaiting_blocks: deque[Request] = deque()
        self.spec_decode = SpecDecodeCounts()

    # ---- queues --------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a new request (status WAITING) at the back."""
        req.status = RequestStatus.WAITING
        if req.sampling_params.n > 1 and req.index == 0:
            self._leaders[req.parent_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reserve(self, req: Request, queue: bool = False) -> bool:
        """Decode role: hold blocks for `req`'s prompt (and prior outputs), whose KV another worker
        computed and is about to send. The request waits (WAITING_FOR_KV) outside the queue until
        `commit`. False when the blocks are not free or earlier reservations still wait for
        theirs (first come first served): with `queue`, `req` then waits (WAITING_FOR_BLOCKS)
        for `grant_reservations`; without, nothing changes. ValueError, changing nothing, when
        it needs more blocks than the whole cache has: it could never be granted."""
        bm = self.block_manager
        if (need := bm.blocks_needed(req.num_tokens)) > bm.num_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs {need} KV blocks for {req.num_tokens} tokens, "
                f"more than the whole cache holds ({bm.num_blocks}): it can never fit"
            )
        if not self.awaiting_blocks and self._hold_for_kv(req):
            return True
        if queue:
            req.status = RequestStatus.WAITING_FOR_BLOCKS
            self.awaiting_blocks.append(req)
        return False

    def grant_reservations(self) -> list[Request]:
        """Decode role: reserve the blocks of queued reservations in arrival order while the
        first in line fits; it alone decides, so a big early request is never overtaken by small
        later ones. Returns the requests granted (now WAITING_FOR_KV), oldest first."""
        granted = []
        while self.awaiting_blocks and self._hold_for_kv(self.awaiting_blocks[0]):
            granted.append(self.awaiting_blocks.popleft())
        return granted

    def _hold_for_kv(self, req: Request) -> bool:
        """Reserve blocks for `req`'s prompt + prior outputs, sharing the leading blocks this
        worker's prefix cache holds already (decode-side reuse: the sender skips them); their
        tokens are `req.num_cached_tokens`. False, holding nothing, when the rest is not free."""
        bm = self.block_manager
        hits = bm.get_computed_blocks(req, all_tokens=True)
        if not bm.allocate_slots(req, req.num_tokens - len(hits) * bm.block_size, hits):
            return False
        req.num_cached_tokens = len(hits) * bm.block_size
        req.status = RequestStatus.WAITING_FOR_KV
        self.reserved[req.request_id] = req
        return True

    def commit(self, req: Request) -> None:
        """Decode role: `req`'s prompt KV has arrived and its first token is appended; queue it.
        It joins the running batch at the next step that has a seat for it."""
        del self.reserved[req.request_id]
        req.num_computed_tokens = req.num_tokens - 1  # all but the first token, just appended
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def release(self, req: Request) -> None:
        """Prefill role: the held blocks of a finished request have been exported; free them."""
        if self.held.pop(req.request_id, None) is not None:
            self.block_manager.free(req)

    def finish(self, req: Request, status: RequestStatus, hold: bool = False) -> None:
        """End `req` with a finished `status`, wherever it is, and free its blocks — or, with
        `hold`, keep them until `release`. Idempotent; aborting a held request frees it."""
        if req.is_finished:
            if status == RequestStatus.FINISHED_ABORTED:
                self.release(req)
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_KV:
            del self.reserved[req.request_id]
        elif req.status == RequestStatus.WAITING_FOR_BLOCKS:
            self.awaiting_blocks.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        if hold:
            self.held[req.request_id] = req
        else:
            self.block_manager.free(req)
        if self._leaders.get(req.parent_id) is req:
            del self._leaders[req.parent_id]

    def paced(self) -> bool:
        """Decode role: whether steps are paced now (`SchedulerConfig.shared_gpu_pace_ms`): the
        prompts reserved here and not yet arrived hold at least `shared_gpu_pace_tokens` tokens
        still to come (those the prefix cache held are not sent); never with 0 tokens."""
        need = self.config.shared_gpu_pace_tokens
        if not self.config.shared_gpu_pace_ms or not need or not self.reserved:
            return False
        for req in self.reserved.values():
            need -= req.num_tokens - req.num_cached_tokens
            if need <= 0:
                return True
        return False

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.reserved) + len(self.awaiting_blocks),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_waiting_for_blocks=len(self.awaiting_blocks),
            num_cached_blocks=bm.num_cached_blocks,
            spec_decode_num_drafts=self.spec_decode.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode.num_draft_tokens,
            spec_decode_num_accepted_tokens=sum(self.spec_decode.accepted_per_pos),
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec_decode.accepted_per_pos),
            running_lora_adapters=tuple(sorted(self.running_loras())),
            waiting_lora_adapters=tuple(sorted(
                {r.lora_name for r in self.waiting if r.lora_name is not None})),
        )

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch under the token budget and `max_num_seqs`.

        NOTE: every request is just "computed tokens catching up with its tokens": a prefill
        chunk and a decode are the same thing with different sizes, so they mix in one batch.
          1. Running requests first, in admission order: each gets up to its remaining tokens
             (1 for a decode, a chunk for an unfinished prefill). When the blocks it needs are
             not free, the most recently admitted running request is preempted (blocks freed,
             recomputed later from scratch) until they are — possibly the request itself.
             A decode with draft tokens (speculative decoding) gets 1 + k: its last token and
             the k drafts, verified in one forward; without the blocks for them, a plain decode.
          2. Then waiting requests in FCFS order, as long as budget, seats and blocks last; none
             is admitted in a step that preempted (it would only be preempted back).
        A prefix-cache hit (or a sibling's prompt blocks, for `n` > 1) is skipped, not computed.
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running, scheduled = self.running, out.scheduled
        bm = self.block_manager
        block_size = bm.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            pending, computed = req.num_pending, req.num_computed_tokens
            num_outputs = len(req.output_token_ids)
            if pending and num_outputs + pending >= req.max_tokens:
                i += 1  # its last token is on its way: nothing more to compute
                continue
            num_tokens = len(req.prompt_token_ids) + num_outputs
            if (num_tokens + pending - computed == 1 and not req.spec_token_ids
                    and computed < len(req.block_ids) * block_size):
                # NOTE: the common case, a plain decode whose slot its last block has: what
                # allocate_slots and _take do for it, inline (a third of a 256-row step's
                # scheduling); its newly full block, if any, is registered first as in _take
                if computed // block_size > req.num_registered_blocks:
                    bm.cache_full_blocks(req)
                scheduled.append(ScheduledRequest(req, 1))
                req.num_computed_tokens = computed + 1
                req.num_pending = pending + 1  # it reaches the end: it samples
                budget -= 1
                i += 1
                continue
            num_new = min(req.num_tokens_to_compute, budget)
            drafts = self._drafts(req, budget) if req.spec_token_ids else None
            if drafts and self.block_manager.allocate_slots(req, 1 + len(drafts)):
                self._take(out, req, 1 + len(drafts), drafts)
                budget -= 1 + len(drafts)
                i += 1
                continue
            while not self.block_manager.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._take(out, req, num_new)
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        loras = self.running_loras()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._lora_fits(req, loras):  # its adapter would exceed max_loras: later
                skipped.append(self.waiting.popleft())
                continue
            if req.block_ids:  # imported KV (decode role): computed up to num_computed_tokens
                computed, num_cached = [], req.num_computed_tokens
            else:
                computed = self._computed_blocks(req, out)
                if computed is None:  # a sibling still computing the shared prompt
                    skipped.append(self.waiting.popleft())
                    continue
                num_cached = len(computed) * self.block_manager.block_size
            num_new = req.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self.block_manager.allocate_slots(req, num_new, computed):
                break
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:
                req.num_cached_tokens = num_cached
                req.metrics.first_scheduled_time = time.monotonic()
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_name is not None:
                loras.add(req.lora_name)
            self._take(out, req, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def running_loras(self) -> set[str]:
        """The LoRA adapters of the running requests."""
        return {r.lora_name for r in self.running if r.lora_name is not None}

    def _lora_fits(self, req: Request, loras: set[str]) -> bool:
        """Whether admitting `req` keeps at most `max_loras` adapters running (vLLM's rule: the
        device has that many slots; a request of another adapter waits for one to drain)."""
        limit = self.config.max_loras
        return (req.lora_name is None or limit is None or req.lora_name in loras
                or len(loras) < limit)

    def _computed_blocks(self, req: Request, out: SchedulerOutput) -> list[int] | None:
        """Blocks `req` can reuse: its prefix-cache hits or, for a later sibling of an `n` > 1
        prompt, the leader's prompt blocks if that gives more. None: wait for the leader, until
        a step before this one has computed its whole prompt."""
        hits = self.block_manager.get_computed_blocks(req)
        leader = self._leaders.get(req.parent_id)
        if leader is None or leader is req or leader.status != RequestStatus.RUNNING:
            return hits
        computing = any(s.request is leader and s.start < leader.num_prompt_tokens
                        for s in out.scheduled)
        if computing or not leader.prompt_done:
            return None
        shareable = (req.num_prompt_tokens - 1) // self.block_manager.block_size
        shared = leader.block_ids[:shareable]
        return shared if len(shared) > len(hits) else hits

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The draft tokens to verify with `req`'s next decode: its proposal, cut to the budget
        and to what max_tokens leaves (the accepted drafts and one more token must fit)."""
        if not req.spec_token_ids or req.num_tokens_to_compute != 1 or req.num_pending:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1)
        return req.spec_token_ids[:max(room, 0)]

    def _take(
        self, out: SchedulerOutput, req: Request, num_new: int, drafts: list[int] | None = None
    ) -> None:
        """Schedule `num_new` tokens of `req` (`drafts` last, if any): they count as computed from
        now on, and a chunk that reaches the end adds a pending token (appended by
        `update_from_output`; with drafts, it may append several and roll the rejected back).

        Blocks filled by earlier steps are registered in the prefix cache first, even while
        such a step is still running on the device: a request admitted now reads them in a
        later step, which the device runs after it."""
        self.block_manager.cache_full_blocks(req)
        scheduled = ScheduledRequest(req, num_new, drafts)
        if req.spec_token_ids:
            req.spec_token_ids = []  # a proposal serves one step
        out.scheduled.append(scheduled)
        req.num_computed_tokens += num_new
        if scheduled.samples:
            req.num_pending += 1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the forward pass ----------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, samples: Mapping[str, Sample | Samples]
    ) -> list[Request]:
        """Append the tokens a launched step sampled, and register newly full blocks.

        `samples` maps the request id of every scheduled request whose chunk `samples` to what
        was sampled: one `Sample`, or for a request verified with drafts the `Samples` it emits
        (the accepted drafts, then the token sampled after them); the rejected drafts' slots
        are rolled back. Applies token-level stops (eos, stop token ids, max_tokens) after each
        token, dropping those after a stop; returns the requests that finished. Requests that
        finished meanwhile (aborted, or stopped by the step before when steps overlap) are
        skipped: their token is discarded.
        """
        finished: list[Request] = []
        block_size = self.block_manager.block_size
        for s in out.scheduled:
            req = s.request
            if s.samples:
                req.num_pending -= 1
            if req.status.finished:
                continue
            if req.num_computed_tokens // block_size > req.num_registered_blocks:
                self.block_manager.cache_full_blocks(req)  # a block filled (its own check)
            if not s.samples:
                continue
            sampled = samples[req.request_id]
            if not s.spec_token_ids:  # one token: the common case
                if req.spec_unverified is not None:
                    spec_policy.judge_unverified(req, sampled[0])
                if self._append(req, *sampled):
                    finished.append(req)
                continue
            emitted = sampled  # verified drafts: the accepted ones, then one more token
            self.spec_decode.count(len(s.spec_token_ids), len(emitted) - 1)
            spec_policy.observe(req, len(s.spec_token_ids), len(emitted) - 1)
            for token_id, logprobs in emitted:
                if self._append(req, token_id, logprobs):
                    finished.append(req)
                    break
            else:  # the rejected drafts' K/V: computed again later
                req.num_computed_tokens = req.num_tokens - 1
                self.block_manager.rollback_slots(req, req.num_computed_tokens)
        return finished

    def _append(self, req: Request, token_id: int, logprobs: tuple | None) -> bool:
        """Append one token and apply token-level stops; True if `req` finished."""
        req.append_token(token_id, logprobs)
        if (len(req.output_token_ids) < req.max_tokens and req.grammar is None
                and token_id not in req.eos_token_ids
                and token_id not in (req.sampling_params.stop_token_ids or ())):
            return False  # nothing can stop it at this token (check_token_stop's rule)
        reason, stop_reason = self._check_stop(req, token_id)
        if reason is None and req.grammar is not None and req.grammar.is_terminated():
            reason = "stop"  # the grammar is complete (it accepted a stop token)
        if reason is None:
            return False
        req.stop_reason = stop_reason
        status = (
            RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
        )
        self.finish(req, status, hold=self.hold_finished)
        return True

    @staticmethod
    def _check_stop(req: Request, token_id: int) -> tuple[str | None, int | None]:
        p = req.sampling_params
        return check_token_stop(
            token_id,
            req.num_output_tokens,
            req.max_tokens,
            p.min_tokens,
            req.eos_token_ids,
            p.stop_token_ids,
            p.ignore_eos,
        )

