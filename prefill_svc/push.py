"""One request's KV push while its prompt is computed: what is final, what is sent, how it ends.

NOTE: the push's life on the prefill worker (event loop only):

    Prefill admitted  ─▶ KVPush + KVWatch; PushKV opens, the header goes out
    KVProgress notes  ─▶ `on_progress`: more cells final; `next_slab` hands out full slabs
                         as they form, and at each step's end whatever is final (flush)
    first token       ─▶ `commit`: the rest is flushed, then the commit chunk goes out
    preemption        ─▶ a new epoch: nothing is final until computed again; a slab read
                         under the old epoch is dropped by the stager, sent cells stay sent

`bytes_before_first_token` and `commit_sent_at - first_token_at` say how much of the transfer
overlapped the compute and how much the second token waited for.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from engine.kv_progress import KVProgress, KVWatch
from engine.kv_transfer import KVLayout, SlabRange
from pdserve.cluster.convert import LogprobsTuple
from prefill_svc.frontier import SlabFrontier


@dataclass(frozen=True)
class SlabTicket:
    """One slab to gather: its range, its blocks' physical ids, and how to read them safely."""

    slab: SlabRange
    block_ids: tuple[int, ...]  # the physical ids of blocks [b0, b1)
    epoch: int
    ready: Any = None  # CUDA: the event to wait for before reading (KVProgress.ready)
    watch: KVWatch | None = None

    def reading(self) -> AbstractContextManager[bool]:
        """Hold off preemption while the slab is read; yields False if it is stale already."""
        return nullcontext(True) if self.watch is None else self.watch.reading(self.epoch)


class KVPush:
    def __init__(
        self, request_id: str, num_tokens: int, layout: KVLayout, slab_bytes: int,
        skip_blocks: int = 0, reserved: bool = True,
    ):
        """`skip_blocks`: the decode worker's prefix cache holds the first blocks (decode-side
        reuse): they are never sent. ValueError if there are not that many blocks. Not
        `reserved`: the decode worker is reserving the blocks still; `reserve` says what it
        reserved, and the push sends nothing before (`reservation`)."""
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.block_size = layout.block_size
        self.num_blocks = -(-num_tokens // layout.block_size)
        self.skip_blocks = skip_blocks
        self.grant: Any = None  # the decode worker's KVTargetGrant for this push, if any
        self.frontier = SlabFrontier(layout, self.num_blocks, slab_bytes, skip_blocks)
        self.watch: KVWatch | None = None  # set for a request computed here
        self.block_ids: tuple[int, ...] = ()
        self.epoch = 0
        self.ready: Any = None
        self.first: tuple[int, LogprobsTuple | None] | None = None
        self.first_token_at: float | None = None  # time.perf_counter()
        self.commit_sent_at: float | None = None
        self.bytes_sent = 0
        self.bytes_before_first_token = 0
        self.ended = False  # set by the servicer once the push stopped, however
        self.reservation = asyncio.Event()  # set once the decode worker's blocks are reserved
        if reserved:
            self.reservation.set()
        self._flush = False
        self._changed = asyncio.Event()

    def reserve(self, skip_blocks: int, grant: Any = None) -> None:
        """The decode worker reserved the blocks (the push was opened before): the first
        `skip_blocks` it holds are never sent, `grant` is its KVTargetGrant. Only once, before
        the push sent anything (it waits for this): ValueError otherwise."""
        if self.reservation.is_set():
            raise ValueError(f"request {self.request_id!r}: its reservation was told already")
        self.frontier.skip(skip_blocks)  # ValueError: out of range
        self.skip_blocks, self.grant = skip_blocks, grant
        self.reservation.set()

    def resize_slabs(self, max_bytes: int) -> None:
        """Cut slabs of at most `max_bytes` from now on (a data plane takes larger ones)."""
        self.frontier.max_bytes = max_bytes

    def computed(
        self, block_ids: list[int], first_token_id: int,
        first_logprobs: LogprobsTuple | None = None,
    ) -> KVPush:
        """This push's KV is in `block_ids` already and its first token known (benchmarks,
        tests): all of it is final at once."""
        layers = self.frontier.num_layers
        self.on_progress(KVProgress(layers, self.num_tokens, self.num_tokens, tuple(block_ids),
                                    self.epoch))
        self.commit(first_token_id, first_logprobs)
        return self

    def on_progress(self, note: KVProgress) -> None:
        """A note from the engine (see `engine.kv_progress`); stale ones are ignored."""
        self._sync_epoch()
        if note.epoch < self.epoch:
            return
        if note.epoch > self.epoch:
            self.epoch = note.epoch
            self.frontier.restart()
        self.block_ids, self.ready = note.block_ids, note.ready
        self.frontier.advance(note.num_layers, note.complete_blocks(self.block_size))
        self._flush |= note.num_layers == self.frontier.num_layers  # a step's end
        self._changed.set()

    def commit(self, first_token_id: int, first_logprobs: LogprobsTuple | None) -> None:
        """The first token is sampled: all of the KV is final; send the rest, then commit."""
        self.first = (first_token_id, first_logprobs)
        self.first_token_at = time.perf_counter()
        self._changed.set()

    async def next_slab(self) -> SlabTicket | None:
        """The next slab to send, once there is one; None when every cell is sent and the
        first token is known (time for the commit chunk)."""
        while True:
            self._sync_epoch()
            slab = self.frontier.next(flush=self._flush or self.first is not None)
            if slab is not None:
                _, _, b0, b1 = slab
                return SlabTicket(slab, self.block_ids[b0:b1], self.epoch, self.ready,
                                  self.watch)
            self._flush = False
            if self.first is not None:
                if not self.frontier.complete:
                    raise RuntimeError(f"request {self.request_id!r} sampled its first token "
                                       "before all of its KV was noted final")
                return None
            self._changed.clear()
            await self._changed.wait()

    def sent(self, ticket: SlabTicket, nbytes: int) -> None:
        """`ticket`'s slab (`nbytes` of KV) went out."""
        self.frontier.mark_sent(ticket.slab)
        self.bytes_sent += nbytes
        if self.first is None:
            self.bytes_before_first_token += nbytes

    def _sync_epoch(self) -> None:
        """Catch up with a preemption at once (its notes may still be on their way)."""
        if self.watch is not None and self.watch.epoch > self.epoch:
            self.epoch = self.watch.epoch
            self.frontier.restart()
