"""engine/core_client.py + engine/core_process.py: the engine's step loop in a process of its own
(a real child process on the bundled model), against the in-process AsyncLLMEngine."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.core_client import EngineCoreClient
from engine.sampling_params import RequestOutputKind, SamplingParams

KWARGS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 16 << 20,
          "device": "cpu"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12,
                             "output_kind": RequestOutputKind.DELTA, **kw})


async def _run(engine, prompt: str, request_id: str, params: SamplingParams):
    ids, logprobs, outputs = [], [], 0
    async for out in engine.generate(prompt, params, request_id):
        outputs += 1
        ids += out.outputs[0].token_ids
        logprobs += [round(step[t].logprob, 4) for t, step in
                     zip(out.outputs[0].token_ids, out.outputs[0].logprobs or [])]
        prompt_ids = out.prompt_token_ids
    return ids, logprobs, prompt_ids


async def _all(engine) -> list:
    return await asyncio.gather(*(_run(engine, p, f"r{i}", _params(logprobs=2))
                                  for i, p in enumerate(PROMPTS)))


@pytest.fixture(scope="module")
def core():
    client = EngineCoreClient.from_args(None, **KWARGS)
    yield client
    client.shutdown()


def test_outputs_equal_the_in_process_engine(core) -> None:
    """Concurrent greedy requests: the same tokens and logprobs as AsyncLLMEngine, and every
    output (not only the first) carries the prompt's ids."""
    in_process = AsyncLLMEngine.from_args(None, **KWARGS)
    try:
        expected = asyncio.run(_all(in_process))
    finally:
        in_process.shutdown()
    got = asyncio.run(_all(core))
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert all(len(ids) == 12 for ids, _, _ in got)
    assert [g[2] for g in got] == [e[2] for e in expected]


def test_a_stream_closed_early_frees_its_blocks(core) -> None:
    async def main():
        stream = core.generate(PROMPTS[0], _params(max_tokens=200), "early")
        async for _ in stream:
            break
        await stream.aclose()
        return await core.stats()

    stats = asyncio.run(main())
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_abort_ends_the_stream_and_frees_its_blocks(core) -> None:
    async def main():
        seen = []

        async def read():
            async for out in core.generate(PROMPTS[1], _params(max_tokens=200), "aborted"):
                seen.append(out)
                if len(seen) == 2:
                    asyncio.get_running_loop().create_task(core.abort("aborted"))
        await asyncio.wait_for(read(), 60)
        return seen, await core.stats(), await core.abort("aborted")

    seen, stats, known_after = asyncio.run(main())
    assert 2 <= len(seen) < 200 and not seen[-1].finished
    assert stats.num_free_blocks == stats.num_total_blocks and not known_after


def test_bad_input_is_a_value_error_and_the_engine_serves_on(core) -> None:
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in core.generate([1] * 300, _params(), "long"):
                pass
        first = core.generate(PROMPTS[0], _params(), "twice")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _run(core, PROMPTS[0], "twice", _params())
        await first.aclose()
        return await _run(core, PROMPTS[2], "after", _params())

    ids, _, _ = asyncio.run(main())
    assert len(ids) == 12


def test_a_bad_engine_argument_raises_in_the_caller() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory of 65536 bytes holds no KV block"):
        EngineCoreClient.from_args(None, **{**KWARGS, "kv_cache_memory": 1 << 16})


def test_a_killed_engine_core_fails_its_streams_and_later_calls() -> None:
    client = EngineCoreClient.from_args(None, **KWARGS)

    async def main():
        stream = client.generate(PROMPTS[0], _params(max_tokens=200), "doomed")
        await stream.__anext__()
        os.kill(client._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not client.is_running
        with pytest.raises(EngineDeadError):
            await client.stats()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        client.shutdown()


def test_servers_that_join_share_the_engine_and_leave_nothing_behind(tmp_path) -> None:
    """A second server joins the first's engine core (`connect`): its requests run there with
    the same outputs; when it goes away mid-request, that request's blocks are freed; when the
    first server stops, the core finishes the others' requests, then ends."""
    path = str(tmp_path / "core.sock")
    owner = EngineCoreClient.from_args(None, listen=path, **KWARGS)
    try:
        joined = EngineCoreClient.connect(path, timeout_s=30)
        expected = asyncio.run(_run(owner, PROMPTS[0], "a", _params()))
        assert asyncio.run(_run(joined, PROMPTS[0], "b", _params())) == expected
        assert joined.engine.max_model_len == 256

        async def leave_mid_request():
            stream = joined.generate(PROMPTS[1], _params(max_tokens=200), "left")
            await stream.__anext__()
            joined.shutdown()  # gone without closing its stream
            for _ in range(100):
                stats = await owner.stats()
                if stats.num_running == 0:
                    return stats
                await asyncio.sleep(0.05)
            return stats

        stats = asyncio.run(leave_mid_request())
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks

        # The first server stops (it drained its own requests): the engine core finishes what
        # another server's requests still need, then ends.
        late = EngineCoreClient.connect(path, timeout_s=30)

        async def finish_after_the_owner_stops():
            stream = late.generate(PROMPTS[2], _params(max_tokens=40), "late")
            outputs = [await stream.__anext__()]
            stopping = asyncio.create_task(asyncio.to_thread(owner.shutdown))
            outputs += [out async for out in stream]
            await stopping
            return outputs

        outputs = asyncio.run(finish_after_the_owner_stops())
        assert outputs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outputs) == 40
        late.shutdown()
    finally:
        owner.shutdown()
    assert owner._proc.returncode == 0 and not os.path.exists(path)


def test_shutdown_stops_the_child(core) -> None:
    client = EngineCoreClient.from_args(None, **KWARGS)
    client.shutdown()
    assert client._proc.returncode == 0 and not client.is_running


def test_the_child_exits_when_its_parent_dies() -> None:
    """A parent killed without shutdown (SIGKILL) leaves no engine behind."""
    code = ("import os, signal, sys; from engine.core_client import EngineCoreClient; "
            f"c = EngineCoreClient.from_args(None, **{KWARGS!r}); print(c._proc.pid, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    child = int(out.stdout.split()[0])
    for _ in range(100):
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    pytest.fail(f"the engine core process {child} outlived its parent")


@pytest.mark.slow
def test_pdserve_up_colocated_with_the_engine_in_its_own_process(tmp_path) -> None:
    """The README's server with `--engine-core process`, driven by the official openai client:
    greedy text equal to `LLM`'s, streamed or not, and a stream closed early frees its blocks."""
    import httpx
    import openai
    from cluster import run_cluster

    from pdserve import LLM

    prompt = "Q: What is the boiling point of water at sea level?\nA:"
    expected = LLM(kv_cache_memory=32 << 20, max_model_len=512).generate(
        prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    with run_cluster(tmp_path, "--colocated", "--engine-core", "process",
                     "--kv-cache-memory", str(32 << 20), "--max-model-len", "512") as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                          temperature=0)
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                             temperature=0, stream=True)
        assert whole.choices[0].text == "".join(ch.choices[0].text for ch in streamed) == expected
        cut = client.completions.create(model=model, prompt=prompt, max_tokens=400,
                                        temperature=0, stream=True)
        next(iter(cut))
        cut.close()
        for _ in range(100):
            (worker,) = httpx.get(c.url + "/workers").json()["workers"]
            if worker["num_running"] == 0:
                break
            time.sleep(0.1)
        assert worker["num_free_blocks"] == worker["num_total_blocks"]

        # SIGTERM (to the server and its engine core alike, as a process group's would be):
        # the stream in flight finishes, then both processes end.
        server = c.pids()["gateway"]
        (core,) = _children(server, "engine.core_process")
        draining = client.completions.create(model=model, prompt=prompt, max_tokens=48,
                                             temperature=0, stream=True)
        chunks = iter(draining)
        first = next(chunks)
        os.kill(core, signal.SIGTERM)
        os.kill(server, signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert len([first, *rest]) >= 40
        c.proc.wait(60)
        assert not _children(server, "engine.core_process") and not os.path.exists(f"/proc/{core}")


def _children(pid: int, marker: str) -> list[int]:
    """The live processes whose parent is `pid` and whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state != "Z" and marker in cmd:
            found.append(int(entry))
    return found


@pytest.mark.slow
def test_pdserve_up_colocated_api_servers_share_one_engine_core(tmp_path) -> None:
    """`pdserve up --colocated --api-server-count 2`: two HTTP servers on one port, one engine
    core (started by the first); streams from fresh connections all complete alike, and the
    engine's blocks are free after."""
    import httpx
    import openai
    from cluster import run_cluster

    prompt = "The capital of France is"
    with run_cluster(tmp_path, "--colocated", "--api-server-count", "2",
                     "--kv-cache-memory", str(32 << 20), "--max-model-len", "512") as c:
        pids = c.pids()
        assert len(_children(pids["gateway"], "engine.core_process")) == 1
        assert not _children(pids["gateway-1"], "engine.core_process")
        (model,) = [m["id"] for m in httpx.get(c.url + "/v1/models").json()["data"]]

        async def one() -> str:
            async with openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused",
                                          max_retries=0) as client:
                stream = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
                return "".join([ch.choices[0].text async for ch in stream])

        async def main() -> list[str]:
            return await asyncio.gather(*(one() for _ in range(6)))

        texts = asyncio.run(main())
        assert len(set(texts)) == 1 and texts[0]
        (worker,) = httpx.get(c.url + "/workers").json()["workers"]
        assert worker["num_running"] == 0
        assert worker["num_free_blocks"] == worker["num_total_blocks"]
