"""Tensor parallelism on the CPU (gloo, two ranks): TP=2 generates exactly what TP=1 does, and a
rank that dies or hangs fails the engine with a clear error instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.distributed.executor import RankFailure
from pdserve import LLM, SamplingParams

PROMPTS = ["Hello there, how are", "The capital of France is", "1 2 3 4 5 6 7", "Once upon"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _greedy_ids(model: str, tp: int, **kw) -> list[list[int]]:
    kw.setdefault("kv_cache_memory", 8 << 20)
    llm = LLM(model, device="cpu", tensor_parallel_size=tp, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tp2_greedy_equals_tp1(model_fixture, request):
    # tiny_llama: 4 query / 2 KV heads, tied embeddings; tiny_qwen2: 4 / 1 (the KV head is
    # replicated on both ranks), q/k/v biases, untied lm_head
    model = request.getfixturevalue(model_fixture)
    assert _greedy_ids(model, 2) == _greedy_ids(model, 1)


def test_tp2_greedy_equals_tp1_on_the_bundled_model(bundled_path):
    # 9 query / 3 KV heads: rank 0 holds two KV groups, rank 1 one
    kw = dict(max_model_len=256, kv_cache_memory=64 << 20, dtype="float32")  # de-quantized
    assert _greedy_ids(bundled_path, 2, **kw) == _greedy_ids(bundled_path, 1, **kw)


def test_rank_kv_shards_hold_their_heads_only(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        runner = llm.llm_engine.runner
        assert runner.kv_shape_per_layer == (1, 16)  # 2 KV heads of dim 16 over 2 ranks
        assert tuple(runner.kv_pool.shape) == (2, 2, 32, 16, 1, 16)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_rank_fails_the_engine_within_the_timeout(fault, tiny_llama_dir):
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, device="cpu", kv_cache_memory=8 << 20,
                                      tensor_parallel_size=2, distributed_timeout_s=5)
    rank1 = engine.engine.runner.executor.procs[0]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def go() -> float:
        outputs = 0
        with pytest.raises(EngineDeadError) as info:
            async for _ in engine.generate("Hello", params, "r1"):
                outputs += 1
                if outputs == 2:  # mid-generation
                    os.kill(rank1.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                    started = time.monotonic()
        assert isinstance(info.value.__cause__, RankFailure)
        return time.monotonic() - started

    try:
        elapsed = asyncio.run(asyncio.wait_for(go(), 30))
        assert elapsed < 5 + 15  # the timeout, and slack for a loaded 2-core box
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.generate("again", params, "r2").__anext__())
    finally:
        if fault == "hang":
            os.kill(rank1.pid, signal.SIGKILL)
        engine.shutdown()
    assert _dead(rank1.pid)  # (is_alive() can race the executor's watcher reaping it)


def _dead(pid: int, timeout_s: float = 10.0) -> bool:
    """The process `pid` exits within `timeout_s` (gone, or a zombie awaiting its reaper)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_bad_tensor_parallel_size_is_a_value_error(tiny_qwen2_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(tiny_qwen2_dir, device="cpu", tensor_parallel_size=0)
    # 4 query heads, 1 KV head: 3 ranks can split neither (refused before any rank starts)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the 4 query heads"):
        LLM(tiny_qwen2_dir, device="cpu", tensor_parallel_size=3)

