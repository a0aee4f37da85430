"""What a step of T query tokens costs on this machine, measured as the engine runs.

NOTE: the draft policy (policy.py) weighs the tokens a draft may save against the time its row
adds to the step, and that time is nothing like linear: on the CPU a GEMM reads the weights once
per block of rows, so a step costs about the same over a block's rows and jumps past it; a GPU
step costs about the same for 1 to dozens of rows. So the costs are measured, not modelled, from
the wall time of decode-only steps (decodes and verifications, no prompt chunk), with two things
kept apart that a single average per T mixed up:

    drafted or plain  a step verifying drafts pays more than a plain step of as many tokens (its
                      verification rows take the chunked attention path and the rejection
                      sampler: traced on the 2-core CPU at batch 8, one draft row made the step
                      +4-5 ms on 25). At batch 8, T = 8 is always plain and T = 9 always
                      drafted, but at batch 4, T = 8 is drafted: each kind has its own sizes.
    the level         every step gets slower as the contexts grow and faster when a batch
                      restarts, and other processes take the cores for a while. A size measured
                      minutes ago (the ones the policy stopped choosing) must be compared with
                      the current step at today's level: traced, sizes chosen by stale averages
                      cost 35-42 ms where they were estimated at 32.

So a step's cost is level x shape(T, kind): `level` a fast moving average of each step's time
over its size's shape (how much slower than usual steps run now; a size measured only a few
times moves it in proportion: its error is more likely its shape's), `shape` per size and kind a
slower average of its time over the level (at first a plain mean, so that one early step does not
hold). A size's first step is not kept (it pays first-call costs: allocations, a new shape's
kernel set-up), and a step slower than twice its estimate counts as twice it. A size not measured
yet is estimated optimistically, so that the policy tries it and learns:

    between two measured sizes     linear interpolation
    above the largest measured     the largest's shape (as cheap as it: worth a try)
    below the smallest measured    the smallest's shape scaled by T / smallest
    drafted, none measured         the plain estimate; and never below it

Torch-free; seconds from the caller's clock.
"""

from __future__ import annotations

import bisect

LEVEL_WEIGHT = 0.3  # of each step in the level's moving average
SHAPE_WEIGHT = 0.1  # of each step in its size's shape, once it has 1 / SHAPE_WEIGHT steps
CLIP = 2.0  # a measurement counts as at most this many times its estimate


class _Shapes:
    """One kind's shape by size: a moving average of its steps' time over the level."""

    def __init__(self) -> None:
        self.sizes: list[int] = []  # measured sizes, ascending
        self.shape: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.seen: set[int] = set()  # sizes whose first step has run

    def add(self, num_tokens: int, relative: float) -> None:
        n = self.count.get(num_tokens, 0) + 1
        self.count[num_tokens] = n
        if n == 1:
            bisect.insort(self.sizes, num_tokens)
            self.shape[num_tokens] = relative
        else:
            old = self.shape[num_tokens]
            self.shape[num_tokens] = old + max(SHAPE_WEIGHT, 1 / n) * (relative - old)

    def estimate(self, num_tokens: int) -> float | None:
        if not self.sizes:
            return None
        if num_tokens in self.shape:
            return self.shape[num_tokens]
        i = bisect.bisect_left(self.sizes, num_tokens)
        if i == len(self.sizes):
            return self.shape[self.sizes[-1]]
        above = self.sizes[i]
        if i == 0:
            return self.shape[above] * num_tokens / above
        below = self.sizes[i - 1]
        lo, hi = self.shape[below], self.shape[above]
        return lo + (hi - lo) * (num_tokens - below) / (above - below)


class StepCosts:
    def __init__(self) -> None:
        self.level = 1.0  # how slow steps run now against their sizes' shapes
        self._kinds = {False: _Shapes(), True: _Shapes()}  # plain, drafted

    def observe(self, num_tokens: int, seconds: float, drafted: bool = False) -> None:
        """A decode-only step of `num_tokens` query tokens took `seconds`; `drafted`: it
        verified drafts."""
        kind = self._kinds[drafted]
        if num_tokens not in kind.seen:
            kind.seen.add(num_tokens)
            return
        known = kind.shape.get(num_tokens)
        if known is not None:
            seconds = min(seconds, CLIP * self.level * known)
            # a size seen a few times only is more likely off in its shape than the level
            trust = min(1.0, kind.count[num_tokens] * SHAPE_WEIGHT)
            self.level += LEVEL_WEIGHT * trust * (seconds / known - self.level)
        kind.add(num_tokens, seconds / self.level)

    def estimate(self, num_tokens: int, drafted: bool = False) -> float | None:
        """Seconds for a step of `num_tokens` query tokens, verifying drafts or not; None
        before any measurement."""
        plain = self._kinds[False].estimate(num_tokens)
        shape = plain
        if drafted:
            own = self._kinds[True].estimate(num_tokens)
            if own is not None:
                shape = own if plain is None else max(own, plain)
        return None if shape is None else self.level * shape
