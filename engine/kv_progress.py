"""Prefill role: telling a KV sender, while a request's prompt is computed, which KV is final.

NOTE: a watched request (`LLMEngine.add_request(..., kv_watch=)`) reports its progress from the
engine thread as `KVProgress` notes, in order:

    step k, chunk [start, end) of the request's tokens, L layers, groups of g layers:
      start > reported     KVProgress(L, start)     prefix-cache hits (cached blocks are final)
      after layer g, 2g..  KVProgress(n, end)       layers [0, n) hold K/V of tokens [0, end)
      after the forward    KVProgress(L, end)       the step's end; end = total: all of it

A block is final for a layer once all of its tokens are computed through that layer
(`complete_blocks`); the partly filled last block is final when the prompt is. The notes are
made mid-forward on the engine thread: a watch's `notify` runs there, quick and thread-safe,
unless the watch names an event loop (`AsyncLLMEngine.watch_kv`): then the notes of one moment
of a step reach each loop in one hop (`deliver`).

Reading a final block races with nothing but a preemption, which frees the request's blocks
(another request may write them in the next step) and starts it again, maybe on other blocks.
The engine calls `invalidate()` before any later step runs; a reader gathers under
`reading(epoch)`, which waits for no invalidation and says whether its note is still current:

    engine thread   preempt ─▶ invalidate(): lock, epoch += 1 ─▶ next step writes the blocks
    sender thread   with reading(note.epoch) as current: gather only if current

On CUDA a note's `ready` is an event recorded on the compute stream after its layers: a gather
on another stream waits for it first, and finishes (synchronizes) inside `reading`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.loop_hops import call_on_loops

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledRequest


@dataclass(frozen=True)
class KVProgress:
    num_layers: int  # layers [0, num_layers) hold the final K/V of tokens [0, num_tokens)
    num_tokens: int
    total_tokens: int  # the request's tokens whose KV is exported (prompt + prior outputs)
    block_ids: tuple[int, ...]  # the request's blocks now, in order (new ones after a preemption)
    epoch: int  # `KVWatch.epoch` when noted: block ids of an older epoch are stale
    ready: Any = None  # CUDA: a torch.cuda.Event recorded after those layers; None on the CPU

    def complete_blocks(self, block_size: int) -> int:
        """How many leading blocks are final in layers [0, num_layers)."""
        if self.num_tokens >= self.total_tokens:
            return -(-self.total_tokens // block_size)
        return self.num_tokens // block_size


class KVWatch:
    """One watched request's link from the engine thread to its sender."""

    def __init__(self, notify: Callable[[KVProgress], None], layers_per_group: int = 1,
                 loop: asyncio.AbstractEventLoop | None = None):
        """`notify` runs on `loop` when given (the notes of one moment of a step reach a loop
        in one `call_soon_threadsafe`: `deliver`), else on the engine thread."""
        if layers_per_group < 1:
            raise ValueError(f"layers_per_group must be >= 1, got {layers_per_group}")
        self.notify = notify
        self.loop = loop
        self.layers_per_group = layers_per_group
        self.epoch = 0  # bumped by `invalidate`; read by any thread
        self.reported = 0  # engine thread: tokens noted final through every layer, this epoch
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        """Engine thread, before the request's freed blocks can be written again: wait for the
        gather in progress, then make every earlier note stale."""
        with self._lock:
            self.epoch += 1
            self.reported = 0

    @contextmanager
    def reading(self, epoch: int) -> Iterator[bool]:
        """Sender thread: hold off `invalidate` for the block; True if `epoch` is current."""
        with self._lock:
            yield epoch == self.epoch


class StepNotes:
    """The notes of one step for the watched requests it computes (engine thread).

    `mark()` gives a note's `ready` (`ModelRunner.mark_ready`). Call `begin()` before the
    forward, pass `on_layer` to it, and call `end()` after it."""

    def __init__(
        self, chunks: list[tuple[KVWatch, ScheduledRequest]], num_layers: int,
        mark: Callable[[], Any],
    ):
        self.chunks = chunks
        self.num_layers = num_layers
        self.mark = mark

    def begin(self) -> None:
        """Tokens already final before this step's chunk (prefix-cache hits)."""
        ready, notes = None, []
        for watch, s in self.chunks:
            if s.start > watch.reported:
                ready = self.mark() if ready is None else ready
                notes.append(self._note(watch, s, self.num_layers, s.start, ready))
        deliver(notes)

    def on_layer(self, num_layers: int) -> None:
        """Layers [0, num_layers) have written this step's K/V: note every group's end."""
        if num_layers == self.num_layers:
            return  # `end` notes it, after the forward
        ready, notes = None, []
        for watch, s in self.chunks:
            if num_layers % watch.layers_per_group == 0:
                ready = self.mark() if ready is None else ready
                notes.append(self._note(watch, s, num_layers, s.start + s.num_new_tokens,
                                        ready))
        deliver(notes)

    def end(self) -> None:
        ready = self.mark()
        deliver([self._note(watch, s, self.num_layers, s.start + s.num_new_tokens, ready)
                 for watch, s in self.chunks])

    def _note(
        self, watch: KVWatch, s: ScheduledRequest, num_layers: int, num_tokens: int,
        ready: Any = None,
    ) -> tuple[KVWatch, KVProgress]:
        req = s.request  # its sampled token is not appended yet: num_tokens is the KV's
        if num_layers == self.num_layers:
            watch.reported = max(watch.reported, num_tokens)
        return watch, KVProgress(num_layers, num_tokens, req.num_tokens, tuple(req.block_ids),
                                 watch.epoch, ready)


def deliver(notes: list[tuple[KVWatch, KVProgress]]) -> None:
    """Hand each note to its watch's `notify`, in order: those of watches on an event loop one
    hop per loop (engine/loop_hops.py), the others at once."""
    call_on_loops((watch.loop, watch.notify, note) for watch, note in notes
                  if watch.loop is not None)
    for watch, note in notes:
        if watch.loop is None:
            watch.notify(note)
