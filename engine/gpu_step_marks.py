"""Prefill steps in flight on a GPU shared with a decode worker, marked where the decode
worker's engine reads them.

NOTE: two processes on one GPU time-slice it: a prompt's prefill step, launched while the decode
worker beside it steps its streams every ~1.3 ms, waits for those steps' kernels and takes
about twice as long as alone (a lone prompt 2.4 ms, 4.8 beside the decodes, one H100,
docs/loadtest.md). A colocated engine has no such wait: its decodes ride inside the prompt's
step. So the prefill engine marks each step of at most MARK_MAX_TOKENS tokens from its launch
until its result is back, and the decode engine starts no step while a mark is up, up to its
pace (`shared_gpu_pace_ms` since its last step started): the decode step already on the GPU
finishes, the prompt then has the GPU to itself, and the decodes wait at most one pace period.

The marks live in one folder per GPU (`SchedulerConfig.shared_gpu_step_marks`): each prefill
engine process owns one file of 8 bytes, the CLOCK_MONOTONIC nanoseconds its step started at,
0 between steps (the clock is the host's, the same in every process). A mark older than
`STALE_S` is a process that died mid-step and holds nothing. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time

STALE_S = 1.0  # a step marked longer ago than this is a dead writer's (steps take ms)
# The largest step marked: a lone prompt's at a low request rate (up to the 512 rows of the
# largest decode graph, which replays it), whose first token the decodes beside it delay. A
# burst's steps of thousands of tokens are not marked: holding the decodes through them (45-60
# ms each) cost the split's saturation 0.69x colocated against 0.84-0.89x unheld (one H100,
# docs/loadtest.md, "The decode worker held by the prefill's step marks").
MARK_MAX_TOKENS = 512
RESCAN_S = 1.0  # the reader lists the folder again this often (writers come and go)
POLL_S = 5e-4  # a decode engine held by a mark looks again this soon (its wait rounds to 1 ms)
_NS = struct.Struct("=q")


class StepMark:
    """The writer: one prefill engine's mark, the file `prefill-<pid>.mark` in `folder`
    (created). `begin(num_tokens)` / `end` around each step (only a small one is marked);
    `close` removes the file, and the folder once no writer's file is left in it."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"prefill-{os.getpid()}.mark")
        with open(self.path, "wb") as f:
            f.write(bytes(_NS.size))
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _NS.size)

    def begin(self, num_tokens: int) -> None:
        """A step of `num_tokens` starts: marked if it is small (MARK_MAX_TOKENS)."""
        if num_tokens <= MARK_MAX_TOKENS:
            _NS.pack_into(self._map, 0, time.monotonic_ns())

    def end(self) -> None:
        _NS.pack_into(self._map, 0, 0)

    def close(self) -> None:
        self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):  # another writer's file still there: kept
            os.rmdir(os.path.dirname(self.path))


class StepMarks:
    """The reader: whether any prefill engine marking steps in `folder` has one in flight."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._maps: dict[str, mmap.mmap] = {}
        self._scanned_at = float("-inf")

    def busy(self) -> bool:
        """True while a live writer's step is marked (a read of one word per writer; the
        folder listed again at most every RESCAN_S)."""
        now_ns = time.monotonic_ns()
        if now_ns / 1e9 - self._scanned_at >= RESCAN_S:
            self._rescan(now_ns / 1e9)
        for m in self._maps.values():
            since = _NS.unpack_from(m, 0)[0]
            if since and now_ns - since < STALE_S * 1e9:
                return True
        return False

    def _rescan(self, now_s: float) -> None:
        self._scanned_at = now_s
        try:
            names = {n for n in os.listdir(self.folder) if n.endswith(".mark")}
        except FileNotFoundError:
            names = set()
        for gone in set(self._maps) - names:
            self._maps.pop(gone).close()
        for name in names - set(self._maps):
            try:
                with open(os.path.join(self.folder, name), "rb") as f:
                    self._maps[name] = mmap.mmap(f.fileno(), _NS.size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # removed meanwhile, or not yet written
                continue

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
