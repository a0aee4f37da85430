"""The engine flags of `pdserve serve|prefill|decode` and `pdserve demo|generate` reach the
engine's arguments (no engine starts): the tensor-parallel size and the distributed timeout,
from the command line or their PDSERVE_* fallbacks, and the worker publishes its size."""

from __future__ import annotations

import argparse
import asyncio
import inspect
from typing import Any

import pytest

from engine.llm import build_engine_config
from engine.scheduler_output import SchedulerStats
from pdserve.cli import _engine_kwargs, build_parser
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.worker import WorkerMonitor, build_engine

ENV = ("PDSERVE_TENSOR_PARALLEL_SIZE", "PDSERVE_DISTRIBUTED_TIMEOUT_SECONDS",
       "PDSERVE_ENABLE_EXPERT_PARALLEL")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def _engine_args(monkeypatch: pytest.MonkeyPatch, args: argparse.Namespace) -> dict[str, Any]:
    """What `build_engine(args, ...)` hands AsyncLLMEngine.from_args (or, for `pdserve
    serve`, EngineCoreClient.from_args: its engine core runs in a process of its own), checked
    against build_engine_config's signature."""
    from decode_svc.core_client import DecodeCoreClient
    from engine.async_engine import AsyncLLMEngine
    from engine.core_client import EngineCoreClient

    seen: dict[str, Any] = {}

    def fake(cls: type) -> Any:
        def from_args(model: str | None, listen: str = "", options: dict | None = None,
                      **kwargs: Any) -> str:
            seen.update(kwargs, options=options)
            return cls.__name__
        return staticmethod(from_args)

    for cls in (AsyncLLMEngine, EngineCoreClient, DecodeCoreClient):
        monkeypatch.setattr(cls, "from_args", fake(cls))
    role = "colocated" if args.command == "serve" else args.command
    expected = {"serve": "EngineCoreClient"}.get(args.command, "AsyncLLMEngine")
    if getattr(args, "engine_core", "") == "process" and role == "decode":
        expected = "DecodeCoreClient"
    assert build_engine(args, role) == expected
    options = seen.pop("options")
    if expected == "DecodeCoreClient":
        assert options == {"kv_transport": args.kv_transport}
    inspect.signature(build_engine_config).bind(args.model, **seen)
    return seen


@pytest.mark.parametrize("command", ["serve", "prefill", "decode", "decode --engine-core process"])
def test_service_flags_reach_the_engine(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args([*command.split(), "--tensor-parallel-size", "2",
                                      "--distributed-timeout-seconds", "7.5"])
    seen = _engine_args(monkeypatch, args)
    assert (seen["tensor_parallel_size"], seen["distributed_timeout_s"]) == (2, 7.5)
    assert seen["enable_expert_parallel"] is False and seen["enforce_eager"] is False
    assert seen["stream_interval"] == 1
    args = build_parser().parse_args([*command.split(), "--enable-expert-parallel",
                                      "--enforce-eager", "--stream-interval", "5"])
    seen = _engine_args(monkeypatch, args)
    assert seen["enable_expert_parallel"] is True and seen["enforce_eager"] is True
    assert seen["stream_interval"] == 5


@pytest.mark.parametrize("command", ["decode", "decode --engine-core process"])
def test_a_decode_workers_pace_reaches_its_engine(command: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _engine_args(monkeypatch, build_parser().parse_args(command.split()))
    assert (seen["shared_gpu_pace_ms"], seen["shared_gpu_pace_tokens"]) == (4.0, 0)
    args = build_parser().parse_args([*command.split(), "--shared-gpu-pace-ms", "10",
                                      "--shared-gpu-pace-tokens", "512"])
    seen = _engine_args(monkeypatch, args)
    assert (seen["shared_gpu_pace_ms"], seen["shared_gpu_pace_tokens"]) == (10.0, 512)
    assert "shared_gpu_pace_ms" not in _engine_args(
        monkeypatch, build_parser().parse_args(["prefill"]))
    for role in (command.split()[0], "prefill"):
        args = build_parser().parse_args([role, "--shared-gpu-step-marks", "/dev/shm/m"])
        assert _engine_args(monkeypatch, args)["shared_gpu_step_marks"] == "/dev/shm/m"
        assert _engine_args(monkeypatch, build_parser().parse_args([role]))[
            "shared_gpu_step_marks"] is None


def test_service_defaults_and_env_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["decode"])
    assert (args.tensor_parallel_size, args.distributed_timeout_seconds) == (1, 60.0)
    monkeypatch.setenv("PDSERVE_TENSOR_PARALLEL_SIZE", "4")
    monkeypatch.setenv("PDSERVE_DISTRIBUTED_TIMEOUT_SECONDS", "30")
    args = build_parser().parse_args(["prefill"])
    seen = _engine_args(monkeypatch, args)
    assert (seen["tensor_parallel_size"], seen["distributed_timeout_s"]) == (4, 30.0)


@pytest.mark.parametrize("argv, expected", [
    (["demo"], 1), (["demo", "--tensor-parallel-size", "2"], 2),
    (["generate", "hi", "--tensor-parallel-size", "3"], 3),
])
def test_offline_commands_take_the_tp_size(argv: list[str], expected: int) -> None:
    kwargs = _engine_kwargs(build_parser().parse_args(argv))
    assert kwargs["tensor_parallel_size"] == expected
    assert kwargs["enable_expert_parallel"] is False and kwargs["enforce_eager"] is False
    inspect.signature(build_engine_config).bind(None, **kwargs)


def test_worker_publishes_its_tp_size() -> None:
    class Engine:
        async def stats(self) -> SchedulerStats:
            return SchedulerStats(1, 2, 3, 4, 0.5, 0, 0, 0)

    monitor = WorkerMonitor("decode", "10.0.0.2:50061", Engine(), tensor_parallel_size=2)
    info = asyncio.run(monitor.info())
    assert (info.tensor_parallel_size, info.num_running, info.num_total_blocks) == (2, 1, 4)
    assert WorkerInfo.from_json(info.to_json()) == info


def test_an_engine_core_listen_socket_needs_the_engine_core_process() -> None:
    """A first server told to listen for others while its engine runs in a thread (e.g.
    PDSERVE_ENGINE_CORE=thread under `pdserve up --colocated --api-server-count 2`) fails at
    once: the others would wait for a socket nobody opens."""
    args = build_parser().parse_args(["serve", "--engine-core", "thread",
                                      "--engine-core-listen", "/tmp/pdserve-core.sock"])
    with pytest.raises(ValueError, match="--engine-core-listen: only with --engine-core process"):
        build_engine(args, "colocated")


@pytest.mark.parametrize(("argv", "cuda", "expected"), [
    (["decode"], True, "process"),  # auto: a GPU worker without tensor parallelism
    (["decode"], False, "thread"),  # auto on the CPU
    (["decode", "--tensor-parallel-size", "2"], True, "thread"),  # the process refuses TP
    (["decode", "--device", "cpu"], True, "thread"),
    (["decode", "--engine-core", "process"], False, "process"),  # as asked
    (["decode", "--engine-core", "thread"], True, "thread"),
    (["prefill"], True, "process"),  # the prefill worker's auto is the decode worker's
    (["prefill"], False, "thread"),
    (["prefill", "--tensor-parallel-size", "2"], True, "thread"),
    (["prefill", "--engine-core", "thread"], True, "thread"),
])
def test_a_worker_resolves_its_engine_core(argv: list[str], cuda: bool, expected: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pdserve.cluster.worker import worker_engine_core

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = build_parser().parse_args(argv)
    assert worker_engine_core(args) == expected
