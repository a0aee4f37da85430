"""Worker faults: a request resumed with its prior output tokens continues the same sequence
(engine), and on a live cluster a prefill worker killed holding a prefill and a decode worker
killed mid-stream cost the client nothing: the same tokens, no error, the moves counted."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import openai
import pytest
from cluster import Cluster, http_get, run_cluster
from live_checks import metric

from engine.kv_transfer import KVSlabWriter, read_slabs
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from pdserve import SamplingParams

PROMPT = "Resume me: a prompt long enough to span more than one block of sixteen tokens each"
# Seeded sampling with every rule that reads earlier outputs: the strictest resume.
SAMPLED = dict(temperature=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
               repetition_penalty=1.2, min_tokens=20, max_tokens=24)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    def make(role: str) -> LLMEngine:
        return LLMEngine(build_engine_config(tiny_llama_dir, dtype="float32", role=role))

    return make("colocated"), make("prefill"), make("decode")


def _run(engine: LLMEngine, rid: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = out.outputs[0].token_ids
    return tokens


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("k", [1, 9])
def test_colocated_resume_continues_the_sequence(engines, greedy, k):
    colocated = engines[0]
    params = SamplingParams(**({"temperature": 0, "max_tokens": 24} if greedy else SAMPLED))
    prompt = colocated.tokenizer.encode(PROMPT)
    colocated.add_request("full", prompt, params)
    full = _run(colocated, "full")
    assert len(full) == 24
    colocated.add_request("resumed", prompt, params, prior_output_token_ids=full[:k])
    assert _run(colocated, "resumed") == full  # prior tokens, then the same continuation


@pytest.mark.parametrize("k", [1, 17])
def test_disaggregated_resume_continues_the_sequence(engines, k):
    """Migration's path: the prefill worker computes prompt + prior outputs and samples the
    next token; the decode worker reserves blocks for both and decodes on."""
    colocated, prefill, decode = engines
    params = SamplingParams(**SAMPLED)
    prompt = colocated.tokenizer.encode(PROMPT)
    colocated.add_request("full", prompt, params)
    full = _run(colocated, "full")
    prior = full[:k]
    prefill.add_request("m", prompt, params, prior_output_token_ids=prior)
    first = _run(prefill, "m")[k:]
    assert first == [full[k]]
    blocks = decode.reserve_request("m", prompt, params, prior_output_token_ids=prior).block_ids
    assert len(blocks) == len(prefill.held_block_ids("m"))
    writer = KVSlabWriter(decode.runner.kv_caches, blocks)
    for slab in read_slabs(prefill.runner.kv_caches, prefill.held_block_ids("m"), 4 << 20):
        writer.write(slab)
    assert writer.complete and prefill.release("m")
    decode.commit_request("m", first[0], None)
    assert _run(decode, "m") == full
    for e in engines:
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_prior_outputs_are_validated(engines):
    colocated = engines[0]
    with pytest.raises(ValueError, match="leave none"):
        colocated.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2),
                              prior_output_token_ids=[4, 5])
    with pytest.raises(ValueError, match="vocabulary"):
        colocated.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4),
                              prior_output_token_ids=[10**9])
    assert not colocated.has_unfinished_requests()


# ---- a live cluster: kill -9 workers under a request ----------------------------------------
LONG_TEXT = "Numbers: " + " ".join(str(i) for i in range(60))
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("faults")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--prefill", "2", "--decode", "2",
                     "--kv-cache-memory", str(4 << 20), "--dtype", "float32",
                     env={"PDSERVE_MAX_MIGRATIONS": "2"}) as c:
        yield c


def _client(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)


async def _stream(c: Cluster, prompt: str, on_chunk=None) -> tuple[str, str | None]:
    """The streamed completion's text and finish reason; `on_chunk(n)` after each chunk."""
    s = await _client(c).completions.create(model=None, prompt=prompt, max_tokens=MAX_TOKENS,
                                            stream=True, temperature=0,
                                            extra_body={"ignore_eos": True})
    parts, reason = [], None
    async for chunk in s:
        parts.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
        if on_chunk is not None:
            await on_chunk(len(parts))
    return "".join(parts), reason


def _pid_of(c: Cluster, address: str) -> int:
    """The pid of the `pdserve up` child serving gRPC at `address` (host:port)."""
    port = address.rsplit(":", 1)[1]
    for pid in c.pids().values():
        cmdline = Path(f"/proc/{pid}/cmdline")
        if not cmdline.exists():  # killed by an earlier test
            continue
        args = cmdline.read_bytes().split(b"\0")
        if b"--port" in args and args[args.index(b"--port") + 1].decode() == port:
            return pid
    raise LookupError(f"no cluster process serves {address}")


def _metric(c: Cluster, name: str) -> float:
    status, text = http_get(c.url + "/metrics")
    assert status == 200
    m = re.search(rf"^{re.escape(name)}_total (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _assert_no_blocks_held(c: Cluster) -> None:
    deadline = time.monotonic() + 20
    while True:
        held = {a: x.num_total_blocks - x.num_free_blocks for a, x in c.loads().items()}
        if not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(held.values()), held


@pytest.fixture(scope="module")
def expected(cluster) -> str:
    text, reason = asyncio.run(_stream(cluster, LONG_TEXT))  # uninterrupted, same cluster
    assert reason == "length"
    return text


@pytest.mark.slow
def test_prefill_worker_killed_holding_a_prefill(cluster, expected):
    """The prefill worker the router picks is frozen (SIGSTOP), the request sent to it, then it
    is killed: the gateway retries the prefill elsewhere; the decode reservation stays. The
    router (kv_aware) picks the worker that prefilled the same prompt for `expected`, the only
    request this cluster has served before: the one whose prefix cache was queried."""
    def queried() -> list:  # the counters are each worker's last heartbeat's
        return [w for w in cluster.workers("prefill")
                if metric(f"http://{w.metrics_address}/metrics",
                          "pdserve:prefix_cache_queries_total")]

    deadline = time.monotonic() + 20
    while not queried() and time.monotonic() < deadline:
        time.sleep(0.3)
    victim, = queried()
    pid = _pid_of(cluster, victim.address)
    before = _metric(cluster, "pdserve:prefill_retries")

    async def go() -> tuple[str, str | None]:
        os.kill(pid, signal.SIGSTOP)
        task = asyncio.create_task(_stream(cluster, LONG_TEXT))
        await asyncio.sleep(1.5)  # the Prefill call now waits on the frozen worker
        assert not task.done()
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(task, timeout=60)

    assert asyncio.run(go()) == (expected, "length")
    assert _metric(cluster, "pdserve:prefill_retries") == before + 1
    _assert_no_blocks_held(cluster)


@pytest.mark.slow
def test_decode_worker_killed_mid_stream_migrates(cluster, expected):
    before = _metric(cluster, "pdserve:decode_migrations")
    killed: list[str] = []

    async def kill_after(n: int) -> None:
        if n != 10 or killed:
            return
        loads = await asyncio.to_thread(cluster.loads)
        busy = [a for a, x in loads.items() if x.role == "decode" and x.num_running]
        assert len(busy) == 1, busy
        os.kill(_pid_of(cluster, busy[0]), signal.SIGKILL)
        killed.append(busy[0])

    text, reason = asyncio.run(asyncio.wait_for(_stream(cluster, LONG_TEXT, kill_after), 90))
    assert killed
    assert (text, reason) == (expected, "length")  # no token lost, none repeated, no error
    assert _metric(cluster, "pdserve:decode_migrations") == before + 1
    _assert_no_blocks_held(cluster)
