"""The engine's side of disaggregated serving: a prefill-role engine holds a finished request's
blocks until their KV is exported; a decode-role engine reserves blocks for a request whose KV
another worker computes, then commits it for decoding once that KV is written.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.lora.request import LoRARequest
from engine.output_processor import RequestGroup, mark_progress
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


class KVCacheFullError(RuntimeError):
    """Not enough free KV blocks to reserve for an incoming transfer (now, or within the wait
    a decode worker allows, or too many requests wait for blocks already)."""


@dataclass(frozen=True)
class Reservation:
    """A decode worker's blocks for a request whose KV another worker computes."""

    block_ids: list[int]  # in the request's block order
    num_cached_blocks: int  # leading blocks the prefix cache held already: not to be sent


class KVHandoffMixin:
    """`LLMEngine`'s export (prefill role) and import (decode role) of a request's KV blocks.

    Mixed into `LLMEngine` only: it uses the engine's `scheduler`, `block_manager` and `_groups`,
    and its `add_request` and `_forget`."""

    scheduler: Scheduler
    block_manager: BlockManager
    _groups: dict[str, RequestGroup]

    def held_block_ids(self, request_id: str) -> list[int]:
        """Prefill role: the blocks holding a finished request's prompt KV, in order."""
        return list(self.scheduler.held[request_id].block_ids)

    def release(self, request_id: str) -> bool:
        """Prefill role: free a finished request's held blocks (after export or on failure)."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            return False
        self.scheduler.release(req)
        return True

    def reserve_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prior_output_token_ids: list[int] | None = None, max_waiting: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Reservation | None:
        """Decode role: register a request whose prompt KV (and that of its prior outputs, see
        `add_request`) another worker computes, and reserve its blocks, sharing the leading
        ones the prefix cache holds (returned: the sender sends only the blocks after those).
        `lora_request`: the adapter the request decodes under (the prefill worker's too).

        When they are not free, or earlier reservations still wait for theirs, the request
        queues (None returned) if fewer than `max_waiting` do: `grant_reservations` reserves
        them in arrival order as blocks free up; `abort_request` takes one out of the queue.
        Raises KVCacheFullError when it may not queue and ValueError on bad input or a request
        the whole cache could not hold; registers nothing then."""
        if params.n != 1:
            raise ValueError("n must be 1 for a request prefilled elsewhere")
        self.add_request(request_id, prompt_token_ids, params, queue=False,
                         prior_output_token_ids=prior_output_token_ids,
                         lora_request=lora_request)
        req = self._groups[request_id].seqs[0].req
        num_queued = len(self.scheduler.awaiting_blocks)
        try:
            if self.scheduler.reserve(req, queue=num_queued < max_waiting):
                return self._reservation(req)
            if req.status == RequestStatus.WAITING_FOR_BLOCKS:
                return None
            raise KVCacheFullError(
                f"no room for {req.num_tokens} prompt tokens: "
                f"{self.block_manager.num_free_blocks} KV blocks free"
                + (f", {num_queued} requests already waiting for blocks" if num_queued else "")
            )
        except BaseException:
            self._groups.pop(request_id)
            self._forget(req)
            raise

    def grant_reservations(self) -> list[tuple[str, Reservation]]:
        """Decode role: reserve blocks for the requests `reserve_request` queued, first come
        first served, as far as the free blocks go: (request id, its blocks) of each granted."""
        return [(r.request_id, self._reservation(r)) for r in self.scheduler.grant_reservations()]

    def _reservation(self, req: Request) -> Reservation:
        return Reservation(list(req.block_ids),
                           req.num_cached_tokens // self.block_manager.block_size)

    def commit_request(
        self, request_id: str, first_token_id: int, logprobs: tuple[float, dict[int, float]] | None
    ) -> None:
        """Decode role: the prompt KV of a reserved request has been written into its blocks;
        append the token the prefill worker sampled and queue the request for decoding."""
        seq = self._groups[request_id].seqs[0]
        seq.req.append_token(first_token_id, logprobs)
        seq.sent_tokens = seq.req.num_output_tokens  # the caller has these: deltas start after
        mark_progress(seq.req)
        self.scheduler.commit(seq.req)
