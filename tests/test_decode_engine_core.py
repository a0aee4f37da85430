"""decode_svc/engine_core.py + decode_svc/core_client.py: the decode engine's step loop in a
process of its own. The queue for free blocks and the whole KV-fault suite run over it in
test_kv_wait.py and test_kv_transfer_faults.py; here what only a second process can do: the
pool mapped in both, the child dying, tensor parallelism refused, the worker exiting with it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from cluster import free_port
from worker_procs import spawn_worker, stop_all, wait_serving

from decode_svc.core_client import CorePoolExporter, DecodeCoreClient
from engine.config import KVWaitConfig
from engine.gpu_step_marks import StepMark
from engine.kv_transfer import layout_of
from engine.request_streams import EngineDeadError
from engine.sampling_params import SamplingParams
from pdserve.bench.proc_cpu import children

BS, NUM_BLOCKS = 16, 8
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def _client(model: str) -> DecodeCoreClient:
    return DecodeCoreClient.from_args(model, dtype="float32", role="decode", device="cpu",
                                      num_kv_blocks=NUM_BLOCKS, block_size=BS,
                                      max_model_len=NUM_BLOCKS * BS)


def test_tensor_parallelism_is_refused_before_a_process_starts(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        DecodeCoreClient.from_args(tiny_llama_dir, role="decode", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="serves the decode role only"):
        DecodeCoreClient.from_args(tiny_llama_dir, role="prefill")


def test_the_pool_is_one_memory_in_both_processes_then_the_child_dies(
        tiny_llama_dir: str) -> None:
    """The pool mapped here has the engine's layout and DescribeKV's id; a reservation waits
    for blocks in the child's queue; then SIGKILL: the queued reservation and every later
    call end with EngineDeadError, and the mapping here (a slab written into it) stays."""
    client = _client(tiny_llama_dir)
    try:
        caches = client.kv_caches()
        assert layout_of(caches) == client.facts.layout
        assert len(caches) == client.facts.layout.num_layers
        info = CorePoolExporter(client).describe(["nixl"])  # grpc-only worker: no export
        assert info.pool_id == client.facts.pool_id and info.num_blocks == NUM_BLOCKS

        async def scenario() -> None:
            holder = await client.reserve_remote("holder", list(range(10, 10 + 6 * BS)),
                                                 PARAMS)
            assert holder is not None and len(holder.block_ids) == 6
            marker = torch.full_like(caches[0][:, holder.block_ids[0]], 3.5)
            caches[0][:, holder.block_ids[0]] = marker  # as a grpc push's slab writes it
            waiter = asyncio.create_task(client.reserve_remote(
                "waiter", list(range(500, 500 + 4 * BS)), PARAMS,
                wait=KVWaitConfig(30, 4)))
            await asyncio.sleep(0.3)
            assert not waiter.done()
            assert (await client.stats()).num_waiting_for_blocks == 1
            os.kill(client._proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(waiter, 10)
            with pytest.raises(EngineDeadError):
                await client.stats()
            assert not client.is_running
            assert torch.equal(caches[0][:, holder.block_ids[0]], marker)  # still mapped

        asyncio.run(scenario())
    finally:
        client.shutdown()


async def _four_tokens(client: DecodeCoreClient, request_id: str) -> float:
    """Seconds from a request's commit to its last of 4 tokens (3 decode steps after the
    first), reserved and committed as a prefill worker's push would."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert await client.reserve_remote(request_id, list(range(100, 116)), params)
    start = time.monotonic()
    await client.commit_remote(request_id, 7, None)
    async for out in client.stream(request_id):
        tokens = out.outputs[0].token_ids
    assert len(tokens) == 4
    return time.monotonic() - start


def test_steps_are_paced_while_a_burst_is_on_its_way(tiny_llama_dir: str) -> None:
    """shared_gpu_pace_ms: while the prompts reserved and not yet arrived hold the threshold's
    tokens, the engine core starts a step at most once a period (waiting for commands
    meanwhile: a commit still lands); once they are in (here: aborted), at full speed."""
    pace_s = 0.3
    client = DecodeCoreClient.from_args(
        tiny_llama_dir, dtype="float32", role="decode", device="cpu", num_kv_blocks=NUM_BLOCKS,
        block_size=BS, max_model_len=NUM_BLOCKS * BS, shared_gpu_pace_ms=1e3 * pace_s,
        shared_gpu_pace_tokens=3 * BS)

    async def scenario() -> tuple[float, float]:
        assert await client.reserve_remote("burst", list(range(10, 10 + 3 * BS)), PARAMS)
        paced = await _four_tokens(client, "paced")
        assert await client.abort("burst")
        return paced, await _four_tokens(client, "free")

    try:
        paced, free = asyncio.run(scenario())
    finally:
        client.shutdown()
    assert paced >= 2 * pace_s  # three steps: at least two periods between their starts
    assert free < 2 * pace_s


def test_steps_are_held_while_a_prefill_step_is_marked(tiny_llama_dir: str, tmp_path) -> None:
    """shared_gpu_step_marks: while the prefill engine beside it marks a step in flight (this
    process stands in for it), the engine core starts a step at most once a period; once the
    mark ends, at full speed."""
    pace_s = 0.3
    mark = StepMark(str(tmp_path))
    client = DecodeCoreClient.from_args(
        tiny_llama_dir, dtype="float32", role="decode", device="cpu", num_kv_blocks=NUM_BLOCKS,
        block_size=BS, max_model_len=NUM_BLOCKS * BS, shared_gpu_pace_ms=1e3 * pace_s,
        shared_gpu_step_marks=str(tmp_path))

    async def scenario() -> tuple[float, float]:
        mark.begin(1)  # a small step
        held = await _four_tokens(client, "held")
        mark.end()
        return held, await _four_tokens(client, "free")

    try:
        held, free = asyncio.run(scenario())
    finally:
        client.shutdown()
        mark.close()
    assert held >= 2 * pace_s  # three steps: at least two periods between their starts
    assert free < 2 * pace_s


def test_a_decode_worker_exits_when_its_engine_core_dies(tiny_llama_dir: str) -> None:
    """`pdserve decode --engine-core process`: SIGKILL its engine core; the worker leaves
    (exit code 1) instead of serving nothing."""
    port = free_port()
    worker = spawn_worker("decode", tiny_llama_dir, port, "--engine-core", "process",
                          "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len",
                          str(NUM_BLOCKS * BS), "--dtype", "float32")
    try:
        wait_serving(worker, f"127.0.0.1:{port}")
        (child,) = _children(worker.popen.pid, "decode_svc.engine_core")
        os.kill(child, signal.SIGKILL)
        assert worker.popen.wait(timeout=30) == 1
    finally:
        stop_all([worker])



def _children(pid: int, module: str) -> list[int]:
    """`proc_cpu.children`, waiting up to 10 s for one."""
    deadline = time.monotonic() + 10
    while not (found := children(pid, module)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
