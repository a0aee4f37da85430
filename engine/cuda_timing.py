"""Timing GPU work as decode steps run it: captured back to back in one CUDA graph, replayed.

Shared by the load-time decode GEMV plan (engine/models/gemv_plan.py) and the benchmarks that
time kernels the same way (pdserve/bench/gpu_lora_kernels.py, gpu_decode_profile.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

import torch


def replays_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds for `replays` back-to-back replays of `graph`, between two CUDA events
    (waits for the second)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_us(calls: Iterable[Callable[[], object]], replays: int = 5, rounds: int = 3) -> float:
    """Median microseconds per call of `calls`: each run once outside the capture (compiles,
    the allocator's first blocks), all captured back to back in one CUDA graph, replayed once,
    then `rounds` timings of `replays` replays each."""
    calls = list(calls)
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    samples = [replays_ms(graph, replays) * 1e3 / (replays * len(calls)) for _ in range(rounds)]
    return statistics.median(samples)
