"""Seconds this process has spent blocked on the device for a step's sampled tokens.

The step timeline (engine/step_timeline.py) reads the total before and after each step: a
step whose wall time is mostly this waited for the GPU (device-bound, or its context
time-sliced with another process's); one with little of it was paced by the host. CUDA's
default synchronisation spins while a machine's cores outnumber its contexts, so the thread's
CPU time cannot tell the two apart. Only the sampled tokens' wait is counted
(`SampledTokens.to_host`, a step's one synchronisation on the plain path); a step that
synchronises elsewhere too (speculative verification, raw logprobs' gathers) waits more than
this says.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_waited_s = 0.0


def waited_s() -> float:
    """The total so far (seconds)."""
    return _waited_s


def timed_wait(wait: Callable[[], object]) -> None:
    """Run `wait()` (a synchronisation) and add its wall time to the total."""
    global _waited_s
    start = time.perf_counter()
    wait()
    _waited_s += time.perf_counter() - start
