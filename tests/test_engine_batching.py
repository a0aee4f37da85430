"""The same greedy tokens under prefix caching, preemption, chunked prefill and async arrival.

Each configuration must reproduce HF transformers exactly, and the mechanism it exercises must be
observed (hits counted, preemptions counted, chunks scheduled), not assumed.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest
import torch

from engine.model_loader import load_hf_model
from pdserve import LLM, AsyncLLMEngine, SamplingParams

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=False)
SHARED = "You are a helpful assistant. Answer briefly and precisely, and never make things up. "


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    from engine.model_loader import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    texts = [
        SHARED + "What is the tallest mountain?",
        SHARED + "Name a prime number larger than ten.",
        "A completely different prompt that shares nothing",
        SHARED * 3 + "Summarise the text above.",
        "Short",
        SHARED + "What is the tallest mountain? And the second?",
    ]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts, hf_oracle) -> list[list[int]]:
    hf = load_hf_model(tiny_llama_dir, torch.float32)
    llm_eos = LLM(tiny_llama_dir, dtype="float32").llm_engine.eos_token_ids
    return hf_oracle(hf, prompts, MAX_NEW, llm_eos)


def run(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_prefix_cache_hits_give_same_tokens(tiny_llama_dir, prompts, expected):
    llm = LLM(tiny_llama_dir, dtype="float32", enable_prefix_caching=True)
    assert run(llm, prompts[:1]) == expected[:1]
    assert run(llm, prompts) == expected
    bm = llm.llm_engine.block_manager
    assert bm.prefix_cache_hits >= 16 * 4  # the shared system prompt is ≥ 1 block, 4 reuses
    assert run(llm, prompts) == expected  # everything cached now
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o, p in zip(outs, prompts) if len(p) > 16)


def test_preemption_under_small_kv_budget_gives_same_tokens(tiny_llama_dir, prompts, expected):
    longest = max(len(p) for p in prompts) + MAX_NEW
    blocks = -(-longest // 16) + 2  # room for one long request and a bit: forces preemption
    llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=blocks, max_model_len=blocks * 16,
              enable_prefix_caching=False)
    assert run(llm, prompts) == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.block_manager.num_free_blocks == blocks


def test_chunked_prefill_gives_same_tokens(tiny_llama_dir, prompts, expected):
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_batched_tokens=8,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    chunks: list[int] = []
    original = engine.scheduler.schedule

    def spy():
        out = original()
        chunks.extend(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= 8
        return out

    engine.scheduler.schedule = spy
    assert run(llm, prompts) == expected
    assert max(chunks) == 8 and len(chunks) > sum(len(p) for p in prompts) // 8


def test_async_requests_joining_a_running_batch(tiny_llama_dir, prompts, expected):
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32")
    steps_seen: dict[str, int] = {}

    async def one(i: int, delay: float) -> list[int]:
        await asyncio.sleep(delay)
        final = None
        async for out in engine.generate(prompts[i], GREEDY, f"req-{i}"):
            steps_seen[f"req-{i}"] = steps_seen.get(f"req-{i}", 0) + 1
            final = out
        return final.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(i, 0.05 * i) for i in range(len(prompts))))

    try:
        got = asyncio.run(main())
        stats = asyncio.run(engine.stats())
    finally:
        engine.shutdown()
    assert got == expected
    assert all(n > 1 for n in steps_seen.values())  # streamed, not one final blob
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_async_abort_frees_blocks(tiny_llama_dir, prompts):
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        seen = 0
        async with aclosing(engine.generate(prompts[0], params, "long")) as stream:
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break  # the client goes away mid-stream
        cancelled = asyncio.create_task(consume(engine.generate(prompts[1], params, "cancelled")))
        await asyncio.sleep(0.3)
        cancelled.cancel()  # a dropped connection cancels the task serving it
        await asyncio.gather(cancelled, return_exceptions=True)
        return seen, await engine.stats()

    async def consume(stream):
        async for _ in stream:
            pass

    try:
        seen, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert seen == 3
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_async_cancel_while_the_add_is_still_queued_leaves_nothing(tiny_llama_dir, prompts):
    """A caller cancelled before the engine thread has even run its add_request: the request
    must not be added and then left running with no reader."""
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        busy = asyncio.create_task(engine.call(time.sleep, 0.5))  # holds the engine thread
        await asyncio.sleep(0.05)
        task = asyncio.create_task(anext(engine.generate(prompts[0], params, "early")))
        await asyncio.sleep(0.05)  # generate() is now awaiting its queued add_request
        task.cancel()
        await asyncio.gather(task, busy, return_exceptions=True)
        await engine.call(time.sleep, 0.05)  # every queued command (add, then abort) has run
        return await engine.stats(), engine.engine.has_unfinished_requests()

    try:
        stats, unfinished = asyncio.run(main())
    finally:
        engine.shutdown()
    assert not unfinished
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
