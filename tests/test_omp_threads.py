"""engine/omp_threads.py and where AsyncLLMEngine builds its engine: a serial thread's torch ops
start no OpenMP team (its team size is 1, other threads keep theirs), and an engine given as a
builder is built on the engine's own thread, its failure raised to the caller; passive OpenMP
waits are a default the environment overrides."""

from __future__ import annotations

import os
import threading
import types

import pytest
import torch

from engine.async_engine import AsyncLLMEngine
from engine.omp_threads import _libgomp, serial_executor, serial_thread


def _in_thread(fn):  # fn's result on a fresh thread
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.skipif(_libgomp() is None, reason="no libgomp here")
def test_a_serial_thread_runs_torch_without_a_team_and_others_keep_theirs() -> None:
    threads = torch.get_num_threads()

    def serial() -> int:
        serial_thread()
        torch.ones(1 << 20).sum()  # an op large enough to run in parallel elsewhere
        return torch.get_num_threads()

    assert _in_thread(serial) == 1
    assert _in_thread(torch.get_num_threads) == threads  # a new thread: torch's count
    assert torch.get_num_threads() == threads
    with serial_executor() as pool:
        assert pool.submit(torch.get_num_threads).result() == 1


class _Engine:
    """What AsyncLLMEngine touches of an engine it builds and never steps."""

    def __init__(self) -> None:
        self.built_on = threading.current_thread().name
        self.config = types.SimpleNamespace(role="colocated")
        self.runner = types.SimpleNamespace(on_rank_failure=lambda callback: None)

    def has_work(self) -> bool:
        return False

    def grant_reservations(self) -> list:
        return []

    def shutdown(self) -> None:
        pass


def test_a_builder_runs_on_the_engine_thread_and_its_failure_reaches_the_caller() -> None:
    engine = AsyncLLMEngine(_Engine)
    try:
        assert engine.engine.built_on == "pdserve-engine" != threading.current_thread().name
    finally:
        engine.shutdown()

    def bad() -> _Engine:
        raise ValueError("max_model_len: too large")

    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLMEngine(bad)


def test_passive_waits_are_a_default_the_environment_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.omp_threads import wait_passively_by_default

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    wait_passively_by_default()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # the user's say
    wait_passively_by_default()
    assert "OMP_WAIT_POLICY" not in os.environ
