"""SchedulerConfig.shared_gpu_pace_ms: a decode engine beside a prefill worker on its GPU
paces its steps while a burst of prompts is on its way. The scheduler's rule (torch-free), the
engine's delay, and the engine thread's loop waiting it out while commands still run (the
engine core process's loop: tests/test_decode_engine_core.py)."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 16


def _request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=4))


def test_pacing_holds_while_the_reserved_prompts_hold_the_threshold() -> None:
    config = SchedulerConfig(max_model_len=512, shared_gpu_pace_ms=10, shared_gpu_pace_tokens=64)
    scheduler = Scheduler(config, BlockManager(64, BS, enable_prefix_caching=True))
    assert not scheduler.paced()
    a, b = _request("a", 40), _request("b", 30)
    assert scheduler.reserve(a) and not scheduler.paced()  # 40 tokens on their way
    assert scheduler.reserve(b) and scheduler.paced()  # 70
    scheduler.commit(a)
    assert not scheduler.paced()  # a arrived: 30
    scheduler.finish(b, b.status.FINISHED_ABORTED)
    assert not scheduler.paced() and not scheduler.reserved
    off = Scheduler(SchedulerConfig(max_model_len=512, shared_gpu_pace_tokens=1),
                    BlockManager(64, BS, enable_prefix_caching=True))
    assert off.reserve(_request("c", 40)) and not off.paced()  # 0 ms: never held
    marks_only = Scheduler(SchedulerConfig(max_model_len=512, shared_gpu_pace_ms=10),
                           BlockManager(64, BS, enable_prefix_caching=True))
    assert marks_only.reserve(_request("d", 400)) and not marks_only.paced()  # 0 tokens


def test_the_prefix_cache_hits_are_not_on_their_way() -> None:
    config = SchedulerConfig(max_model_len=512, shared_gpu_pace_ms=10, shared_gpu_pace_tokens=40)
    scheduler = Scheduler(config, BlockManager(64, BS, enable_prefix_caching=True))
    first = _request("first", 48)
    assert scheduler.reserve(first) and scheduler.paced()
    scheduler.commit(first)
    first.num_computed_tokens = first.num_tokens  # its KV in place: its blocks cacheable
    scheduler.block_manager.cache_full_blocks(first)
    again = _request("again", 56)  # the same prompt and 8 more: its 3 blocks cached here
    assert scheduler.reserve(again)
    assert again.num_cached_tokens == 3 * BS and not scheduler.paced()  # 8 tokens to come


@pytest.mark.parametrize("bad", [{"shared_gpu_pace_ms": -1.0},
                                 {"shared_gpu_pace_tokens": -1}])
def test_bad_pacing_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(**bad)


class _PacedEngine:
    """An engine stand-in whose steps are paced `pace_s` apart from its first step's start
    until a command `arrives`; it records what ran, in order."""

    def __init__(self, pace_s: float, steps: int) -> None:
        self.config = types.SimpleNamespace(role="decode")
        self.runner = types.SimpleNamespace(on_rank_failure=lambda callback: None)
        self.pace_s, self.left, self.events = pace_s, steps, []
        self.first_at: float | None = None
        self.arrived = False

    def has_work(self) -> bool:
        return self.left > 0

    def step_delay_s(self) -> float:
        if self.first_at is None or self.arrived:
            return 0.0
        return max(0.0, self.first_at + self.pace_s - time.monotonic())

    def step(self) -> list:
        now = time.monotonic()
        self.first_at = self.first_at or now
        self.events.append(("step", now))
        self.left -= 1
        return []

    def arrive(self) -> None:
        self.events.append(("command", time.monotonic()))
        self.arrived = True

    def grant_reservations(self) -> list:
        return []

    def shutdown(self) -> None:
        pass


def _kinds(engine: _PacedEngine) -> list[str]:
    return [kind for kind, _ in engine.events]


def test_the_engine_thread_waits_out_the_delay() -> None:
    engine = _PacedEngine(pace_s=0.3, steps=2)
    async_engine = AsyncLLMEngine(engine)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 10
        while engine.left and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        async_engine.shutdown()
    (_, first), (_, second) = engine.events
    assert second - first >= 0.3  # no command came: the delay alone ended the wait


@pytest.mark.asyncio
async def test_a_command_runs_during_the_delay_and_ends_it() -> None:
    engine = _PacedEngine(pace_s=30.0, steps=2)
    async_engine = AsyncLLMEngine(engine)  # type: ignore[arg-type]
    try:
        while not engine.events:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(async_engine.call(engine.arrive), 10)
        while engine.left:
            await asyncio.sleep(0.01)
    finally:
        async_engine.shutdown()
    assert _kinds(engine) == ["step", "command", "step"]
    assert engine.events[2][1] - engine.events[0][1] < 10  # not the 30 s period
