"""engine/step_budget.py: a server's tokens per step and running requests by device, and
AsyncLLMEngine's use of them."""

from __future__ import annotations

import pytest

from engine import async_engine, step_budget
from engine.step_budget import gpu_limits, server_limits


@pytest.mark.parametrize(("gib", "name", "limits"), [
    (141, "NVIDIA H200", (8192, 1024)), (80, "NVIDIA H100 80GB HBM3", (8192, 1024)),
    (70, "AMD MI300X", (8192, 1024)), (80, "NVIDIA A100-SXM4-80GB", (2048, 256)),
    (48, "NVIDIA L40S", (2048, 256)), (69, "NVIDIA H100", (2048, 256)),
])
def test_large_gpus_get_vllms_larger_limits_except_the_a100(gib: int, name: str,
                                                            limits: tuple[int, int]) -> None:
    assert gpu_limits(gib << 30, name) == limits


def test_the_cpu_keeps_2048_tokens_and_64_requests() -> None:
    assert server_limits("cpu") == (2048, 64)


def test_only_missing_limits_are_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_budget, "server_limits", lambda device: (8192, 1024))
    fill = step_budget.with_server_budget
    assert fill({"device": "cuda"}) == {"device": "cuda", "max_num_batched_tokens": 8192,
                                        "max_num_seqs": 1024}
    given = fill({"device": "cuda", "max_num_batched_tokens": 512, "max_num_seqs": None})
    assert (given["max_num_batched_tokens"], given["max_num_seqs"]) == (512, 1024)
    both = {"device": "cuda", "max_num_batched_tokens": 512, "max_num_seqs": 8}
    assert fill(both) == both
    unchunked = fill({"device": "cuda", "enable_chunked_prefill": False, "max_num_seqs": 8})
    assert "max_num_batched_tokens" not in unchunked and unchunked["max_num_seqs"] == 8


def test_from_args_takes_the_servers_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    monkeypatch.setattr(async_engine, "build_engine_config",
                        lambda model, **kw: seen.append(kw) or kw)
    monkeypatch.setattr(async_engine, "LLMEngine", lambda config: config)
    monkeypatch.setattr(step_budget, "server_limits", lambda device: (8192, 1024))
    monkeypatch.setattr(async_engine.AsyncLLMEngine, "__init__", lambda self, engine: None)
    async_engine.AsyncLLMEngine.from_args(None, device="cuda")
    assert [(kw.get("max_num_batched_tokens"), kw.get("max_num_seqs")) for kw in seen] == [
        (8192, 1024)]
