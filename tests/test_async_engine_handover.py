"""The engine thread hands the event loop its answers before the next step: a caller awaiting a
command resumes before the step that follows it starts (unit test of engine/async_engine.py
with a stand-in for LLMEngine: only the loop's hand-over is under test)."""

from __future__ import annotations

import asyncio
import types

import pytest

from engine.async_engine import AsyncLLMEngine


class _Engine:
    """The surface AsyncLLMEngine's loop touches; each step records whether the caller of the
    command before it had resumed by then."""

    def __init__(self) -> None:
        self.config = types.SimpleNamespace(role="colocated")
        self.runner = types.SimpleNamespace(on_rank_failure=lambda callback: None)
        self.work = False
        self.caller_resumed = False
        self.seen_at_step: list[bool] = []

    def has_work(self) -> bool:
        return self.work

    def step(self) -> list:
        self.seen_at_step.append(self.caller_resumed)
        self.work = False
        return []

    def grant_reservations(self) -> list:
        return []

    def queue_work(self) -> str:
        self.work = True  # the command leaves work: the engine steps right after it
        return "done"

    def shutdown(self) -> None:
        pass


@pytest.mark.asyncio
async def test_a_caller_resumes_before_the_step_after_its_command() -> None:
    engine = _Engine()
    async_engine = AsyncLLMEngine(engine)  # type: ignore[arg-type]
    try:
        for _ in range(20):
            engine.caller_resumed = False
            assert await async_engine.call(engine.queue_work) == "done"
            engine.caller_resumed = True
            while engine.work:  # the step that follows
                await asyncio.sleep(0.001)
        assert engine.seen_at_step == [True] * 20
    finally:
        async_engine.shutdown()
