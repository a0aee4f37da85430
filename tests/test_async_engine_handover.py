"""The engine thread and its callers (unit test of engine/async_engine.py with a stand-in for
LLMEngine: only the loop's hand-overs are under test). A caller awaiting a command resumes
before the step that follows it starts; a KV commit does not wait for the step in flight, and
one that fails ends its request's stream with the error."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

from engine import async_engine as async_engine_module
from engine.async_engine import AsyncLLMEngine
from engine.kv_handoff import Reservation
from engine.outputs import CompletionOutput, RequestOutput
from pdserve import SamplingParams


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

    def step_delay_s(self) -> float:
        return 0.0

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
async def test_a_caller_resumes_before_the_step_after_its_command(monkeypatch) -> None:
    # the hand-over's bound (2 ms) is for serving; here it must not decide the outcome: with
    # the other core busy (the suite beside it) the event loop can take longer to run
    monkeypatch.setattr(async_engine_module, "HANDOVER_S", 10.0)
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


class _DecodeEngine(_Engine):
    """A decode role's surface: a reservation, a commit that emits one finished output at the
    next step (or raises, if told to), and a step that can be held mid-way."""

    def __init__(self) -> None:
        super().__init__()
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.committed: list[str] = []
        self.aborted: list[str] = []
        self.fail_commit = False

    def step(self) -> list:
        self.in_step.set()
        self.release.wait(10)
        self.work = False
        done, self.committed = self.committed, []
        return [RequestOutput(rid, None, [], [CompletionOutput(0, "", [7], finish_reason="length")],
                              finished=True) for rid in done]

    def reserve_request(self, request_id, *args, **kwargs) -> Reservation:
        return Reservation([0, 1], 0)

    def commit_request(self, request_id: str, first_token_id: int, logprobs) -> None:
        if self.fail_commit:
            raise RuntimeError("the scheduler refused it")
        self.committed.append(request_id)
        self.work = True

    def abort_request(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


@pytest.mark.asyncio
async def test_a_commit_returns_without_waiting_for_the_step_in_flight() -> None:
    engine = _DecodeEngine()
    async_engine = AsyncLLMEngine(engine)  # type: ignore[arg-type]
    try:
        assert await async_engine.reserve_remote("r", [1, 2, 3], SamplingParams(max_tokens=2))
        engine.release.clear()
        engine.work = True  # a step of other requests starts and is held there
        await asyncio.to_thread(engine.in_step.wait, 5)
        await asyncio.wait_for(async_engine.commit_remote("r", 7, None), 1.0)
        assert engine.committed == []  # queued behind the step
        engine.release.set()
        outs = [out async for out in async_engine.stream("r")]
        assert [o.outputs[0].token_ids for o in outs] == [[7]] and outs[-1].finished
    finally:
        engine.release.set()
        async_engine.shutdown()


@pytest.mark.asyncio
async def test_a_failed_commit_aborts_the_request_and_ends_its_stream_with_the_error() -> None:
    engine = _DecodeEngine()
    engine.fail_commit = True
    async_engine = AsyncLLMEngine(engine)  # type: ignore[arg-type]
    try:
        assert await async_engine.reserve_remote("r", [1, 2, 3], SamplingParams(max_tokens=2))
        await async_engine.commit_remote("r", 7, None)
        with pytest.raises(RuntimeError, match="the scheduler refused it"):
            async for _ in async_engine.stream("r"):
                pass
        assert set(engine.aborted) == {"r"}  # its blocks freed (the reader aborts it too)
    finally:
        async_engine.shutdown()
