"""When each request is sent: seeded arrival processes, as offsets (seconds) from the run's start.

  poisson   gaps drawn from a gamma distribution of mean 1/rate and shape `burstiness`:
            burstiness 1 is a Poisson process (exponential gaps); below 1 the requests come in
            bursts (more short gaps and a few long ones); above 1 they come more evenly
  constant  one request every 1/rate seconds
  all       every request at once (rate = inf)

The first request is due at 0. The same (kind, count, rate, burstiness, seed) gives the same
offsets on every machine.
"""

from __future__ import annotations

import math
import random

KINDS = ("poisson", "constant", "all")


def arrival_offsets(
    count: int, rate: float, kind: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """`count` non-decreasing send offsets in seconds, the first 0. Raises ValueError."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if kind not in KINDS:
        raise ValueError(f"arrival kind must be one of {KINDS}, got {kind!r}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if kind == "all" or math.isinf(rate):
        return [0.0] * count
    if kind == "constant":
        return [i / rate for i in range(count)]
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.gammavariate(burstiness, scale)
        offsets.append(now)
    return offsets
