"""prefill_svc/engine_core.py + prefill_svc/core_client.py: the prefill engine's step loop in a
process of its own. The KV-fault suite runs over it in test_kv_transfer_faults.py (nixl) and
its grpc push in test_bench_prefill_burst.py; here what only a second process can do: the pool
mapped in both, the KV note ahead of the first token, the held blocks released from here, the
child dying, tensor parallelism refused."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import aclosing

import pytest
import torch
from cluster import free_port
from worker_procs import spawn_worker, stop_all, wait_serving

from engine.async_engine import AsyncLLMEngine
from engine.kv_progress import KVProgress
from engine.request_streams import EngineDeadError
from engine.sampling_params import SamplingParams
from pdserve.bench.proc_cpu import children
from prefill_svc.core_client import PrefillCoreClient

BS, NUM_BLOCKS = 16, 8
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _client(model: str) -> PrefillCoreClient:
    return PrefillCoreClient.from_args(model, dtype="float32", role="prefill", device="cpu",
                                       num_kv_blocks=NUM_BLOCKS, block_size=BS,
                                       max_model_len=NUM_BLOCKS * BS)


def test_tensor_parallelism_is_refused_before_a_process_starts(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        PrefillCoreClient.from_args(tiny_llama_dir, role="prefill", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="serves the prefill role only"):
        PrefillCoreClient.from_args(tiny_llama_dir, role="decode")


def test_the_note_names_the_held_blocks_before_the_first_token_then_the_child_dies(
        tiny_llama_dir: str) -> None:
    """A watched request: one note, all of its KV final, reaches the loop before its first
    token; its blocks hold that KV in the pool mapped here (what the in-thread engine computes
    for the same request, exactly) and stay held until `release`. An unwatched one gets no
    note. Then SIGKILL: calls end with EngineDeadError, and the mapping here stays."""
    client = _client(tiny_llama_dir)
    prompt, prior = list(range(10, 10 + 2 * BS + 5)), [7, 8]
    reference = _in_thread_kv(tiny_llama_dir, prompt, prior)
    try:
        pool = client.kv_pool()
        assert pool.shape[1:3] == (2, NUM_BLOCKS)

        async def scenario() -> None:
            events: list[object] = []
            watch = client.watch_kv(events.append)
            async with aclosing(client.generate(prompt, PARAMS, "a", prior,
                                                kv_watch=watch)) as outs:
                async for out in outs:
                    events.append(out)
            note, final = events
            assert isinstance(note, KVProgress) and final.finished  # type: ignore[union-attr]
            total = len(prompt) + len(prior)
            assert (note.num_layers, note.num_tokens, note.total_tokens) == (
                pool.shape[0], total, total)
            assert len(note.block_ids) == -(-total // BS)
            assert note.complete_blocks(BS) == len(note.block_ids)
            with watch.reading(note.epoch) as current:
                assert current
            assert torch.equal(pool[:, :, list(note.block_ids)], reference)
            assert await client.held_requests() == ["a"]
            plain = [o async for o in client.generate(prompt[:BS], PARAMS, "b")]
            assert plain[-1].finished and sorted(await client.held_requests()) == ["a", "b"]
            assert await client.release("a") and await client.release("b")
            assert not await client.release("a")
            assert await client.held_requests() == []
            with pytest.raises(ValueError, match="n = 1"):
                async for _ in client.generate(prompt, SamplingParams(n=2, max_tokens=2), "c",
                                               kv_watch=client.watch_kv(events.append)):
                    pass
            kept = pool[:, :, note.block_ids[0]].clone()
            os.kill(client._proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                for _ in range(50):
                    await client.stats()
                    await asyncio.sleep(0.1)
            assert not client.is_running
            assert torch.equal(pool[:, :, note.block_ids[0]], kept)  # still mapped

        asyncio.run(scenario())
    finally:
        client.shutdown()


def _in_thread_kv(model: str, prompt: list[int], prior: list[int]) -> torch.Tensor:
    """The request's KV blocks, [L, 2, blocks, ...], as the in-thread engine computes them."""
    engine = AsyncLLMEngine.from_args(model, dtype="float32", role="prefill", device="cpu",
                                      num_kv_blocks=NUM_BLOCKS, block_size=BS,
                                      max_model_len=NUM_BLOCKS * BS)

    async def run() -> torch.Tensor:
        notes: list[KVProgress] = []
        async for _ in engine.generate(prompt, PARAMS, "r", prior,
                                       kv_watch=engine.watch_kv(notes.append)):
            pass
        blocks = list(notes[-1].block_ids)
        return engine.engine.runner.kv_pool[:, :, blocks].clone()

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def test_a_prefill_worker_exits_when_its_engine_core_dies(tiny_llama_dir: str) -> None:
    """`pdserve prefill --engine-core process`: SIGKILL its engine core; the worker leaves
    (exit code 1) instead of serving nothing."""
    port = free_port()
    worker = spawn_worker("prefill", tiny_llama_dir, port, "--engine-core", "process",
                          "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len",
                          str(NUM_BLOCKS * BS), "--dtype", "float32")
    try:
        wait_serving(worker, f"127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while not (found := children(worker.popen.pid, "prefill_svc.engine_core")):
            assert time.monotonic() < deadline, "no engine core process"
            time.sleep(0.1)
        os.kill(found[0], signal.SIGKILL)
        assert worker.popen.wait(timeout=30) == 1
    finally:
        stop_all([worker])
