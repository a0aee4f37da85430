"""cProfile of an engine core's step loop, for where its host time goes under a serving load.

    PDSERVE_CPROFILE_DIR=DIR pdserve up ...   # every engine core process (the colocated
                                              # server's, a decode worker's) writes
        DIR/<role>-<pid>.prof                 # pstats: python -m pstats FILE
    PDSERVE_STACK_SAMPLE_WHILE=PATH           # only while PATH exists (a load's run), as the
                                              # stack samplers (engine/stack_sampler.py)

NOTE: the stack samplers see a thread only when it lets the interpreter lock go, so a loop
that holds it through a step (the engine core's) shows mostly the calls that release it.
cProfile counts every Python call of the thread that enables it: the loop calls `tick` once per
round, which turns the profile on or off as the gate comes and goes (looked at every
GATE_CHECK_S), and `close` writes the stats. Every call costs about a microsecond more under
it, so absolute times grow (most for code of many small calls); where they go is the figure.
"""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path

from engine.stack_sampler import ENV_GATE

ENV_DIR = "PDSERVE_CPROFILE_DIR"
GATE_CHECK_S = 0.05


class LoopProfile:
    def __init__(self, path: Path, gate: str) -> None:
        self.path = path
        self.gate = gate  # profile only while this path exists ("": always)
        self.profile = cProfile.Profile()
        self.on = False
        self.used = False
        self.checked_at = 0.0

    def tick(self) -> None:
        """Once per loop round, on the loop's thread: follow the gate."""
        now = time.monotonic()
        if now - self.checked_at < GATE_CHECK_S:
            return
        self.checked_at = now
        want = not self.gate or os.path.exists(self.gate)
        if want and not self.on:
            self.profile.enable()
            self.used = True
        elif self.on and not want:
            self.profile.disable()
        self.on = want

    def close(self) -> None:
        """Stop and write the stats (nothing when the gate never opened)."""
        if self.on:
            self.profile.disable()
            self.on = False
        if self.used:
            self.profile.dump_stats(str(self.path))


def from_env(role: str) -> LoopProfile | None:
    """A profile for this process's loop when PDSERVE_CPROFILE_DIR names a folder (made if need
    be), named after `role` and the pid; None when it is not set."""
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return LoopProfile(Path(folder) / f"{role}-{os.getpid()}.prof", os.environ.get(ENV_GATE, ""))
