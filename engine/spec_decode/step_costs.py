"""What a step of T query tokens costs on this machine, measured as the engine runs.

NOTE: the draft policy (policy.py) weighs the tokens a draft may save against the time its row
adds to the step, and that time is nothing like linear: on the CPU the int4 matmul of torch
costs about the same for 1 to 4 rows and jumps at 5, a GPU step costs about the same for 1 to
dozens of rows. So the costs are measured, not modelled: a moving average of the wall time of
decode-only steps (decodes and verifications, no prompt chunk) per number of query tokens T.
A size's first step is not kept (it pays first-call costs: allocations, a new shape's kernel
set-up), and a step slower than twice its size's average counts as twice it (another process
took the cores): a size the policy stops choosing is not measured again, so one slow step must
not rule it out for good. A size not measured yet is estimated optimistically, so that the
policy tries it and learns:

    between two measured sizes     linear interpolation
    above the largest measured     the largest's cost (as cheap as it: worth a try)
    below the smallest measured    the smallest's cost scaled by T / smallest

Torch-free; seconds from the caller's clock.
"""

from __future__ import annotations

import bisect

WEIGHT = 0.2  # of each new measurement in a size's moving average
CLIP = 2.0  # a measurement counts as at most this many times its size's average


class StepCosts:
    def __init__(self) -> None:
        self._sizes: list[int] = []  # measured sizes, ascending
        self._seconds: dict[int, float] = {}  # size -> moving average of its steps' wall time
        self._seen: set[int] = set()  # sizes whose first step has run

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step of `num_tokens` query tokens took `seconds`."""
        if num_tokens not in self._seen:
            self._seen.add(num_tokens)
            return
        old = self._seconds.get(num_tokens)
        if old is None:
            bisect.insort(self._sizes, num_tokens)
            self._seconds[num_tokens] = seconds
        else:
            self._seconds[num_tokens] = old + WEIGHT * (min(seconds, CLIP * old) - old)

    def estimate(self, num_tokens: int) -> float | None:
        """Seconds for a step of `num_tokens` query tokens; None before any measurement."""
        if not self._sizes:
            return None
        if num_tokens in self._seconds:
            return self._seconds[num_tokens]
        i = bisect.bisect_left(self._sizes, num_tokens)
        if i == len(self._sizes):
            return self._seconds[self._sizes[-1]]
        above = self._sizes[i]
        if i == 0:
            return self._seconds[above] * num_tokens / above
        below = self._sizes[i - 1]
        lo, hi = self._seconds[below], self._seconds[above]
        return lo + (hi - lo) * (num_tokens - below) / (above - below)
