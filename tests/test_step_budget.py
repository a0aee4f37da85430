"""engine/step_budget.py: a server's tokens per step by device, and AsyncLLMEngine's use of it."""

from __future__ import annotations

import pytest

from engine import async_engine, step_budget
from engine.step_budget import large_gpu_budget, server_step_tokens


@pytest.mark.parametrize(("gib", "name", "budget"), [
    (141, "NVIDIA H200", 8192), (80, "NVIDIA H100 80GB HBM3", 8192), (70, "AMD MI300X", 8192),
    (80, "NVIDIA A100-SXM4-80GB", 2048), (48, "NVIDIA L40S", 2048), (69, "NVIDIA H100", 2048),
])
def test_large_gpus_get_vllms_larger_budget_except_the_a100(gib: int, name: str,
                                                            budget: int) -> None:
    assert large_gpu_budget(gib << 30, name) == budget


def test_the_cpu_keeps_2048() -> None:
    assert server_step_tokens("cpu") == 2048


def test_only_a_missing_budget_is_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_budget, "server_step_tokens", lambda device: 8192)
    fill = step_budget.with_server_budget
    assert fill({"device": "cuda"})["max_num_batched_tokens"] == 8192
    assert fill({"device": "cuda", "max_num_batched_tokens": 512})["max_num_batched_tokens"] == 512
    assert "max_num_batched_tokens" not in fill({"device": "cuda", "enable_chunked_prefill": False})


def test_from_args_takes_the_servers_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    monkeypatch.setattr(async_engine, "build_engine_config",
                        lambda model, **kw: seen.append(kw) or kw)
    monkeypatch.setattr(async_engine, "LLMEngine", lambda config: config)
    monkeypatch.setattr(step_budget, "server_step_tokens", lambda device: 8192)
    monkeypatch.setattr(async_engine.AsyncLLMEngine, "__init__", lambda self, engine: None)
    async_engine.AsyncLLMEngine.from_args(None, device="cuda")
    assert [kw.get("max_num_batched_tokens") for kw in seen] == [8192]
