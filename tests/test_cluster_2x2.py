"""2 prefill + 2 decode workers (tiny random Llama): equality with the colocated engine, a second
stateless gateway on the same Redis, and a decode worker killed mid-stream."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
from cluster import extra_gateway, run_cluster

from pdserve.cluster.registry import PREFILL_BESIDE_RESERVATION

pytestmark = pytest.mark.slow

TEXTS = [
    "The tiny model says",
    "A longer prompt that needs more than one block of sixteen tokens to hold its keys "
    "and values, so the transfer moves several blocks",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Short",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("cluster2x2")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--prefill", "2", "--decode", "2",
                     "--kv-cache-memory", str(4 << 20), "--dtype", "float32") as c:
        yield c


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    from pdserve import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, dtype="float32")
    outs = llm.generate(TEXTS, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


async def _complete_all(url: str, prompts: list[str], **kw) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    rs = await asyncio.gather(*(client.completions.create(model=None, prompt=p, **kw)
                                for p in prompts))
    return [r.choices[0].text for r in rs]


def test_two_by_two_equals_colocated(cluster, expected):
    assert sorted(w.role for w in cluster.workers() if w.role != "tokenizer") == [
        "decode", "decode", "prefill", "prefill"]
    got = asyncio.run(_complete_all(cluster.url, TEXTS * 4, max_tokens=20, temperature=0))
    assert got == expected * 4
    # the prefill workers list the feature, so each Prefill went out beside its reservation
    assert all(PREFILL_BESIDE_RESERVATION in w.features for w in cluster.workers("prefill"))
    assert " beside, prefill " in cluster.log.read_text()


def test_a_second_gateway_on_the_same_redis_serves_the_same_workers(cluster, expected):
    """Gateways keep no state of their own. This one also prefills prompts of up to 8 tokens on
    the decode worker (the short-prompt shortcut), longer ones on a prefill worker."""
    with extra_gateway(cluster, "--local-prefill-max-tokens", "8") as (url, _):
        got = asyncio.run(_complete_all(url, TEXTS, max_tokens=20, temperature=0))
    assert got == expected


def test_decode_worker_killed_mid_stream(cluster, expected):
    decode_pids = {name: pid for name, pid in cluster.pids().items() if name.startswith("decode")}
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)

    async def stream(i: int) -> str:
        try:
            s = await client.completions.create(model=None, prompt=TEXTS[i % 4], max_tokens=400,
                                                stream=True, temperature=0,
                                                extra_body={"ignore_eos": True})
            async for _ in s:
                pass
            return "completed"
        except openai.APIError as exc:
            return f"error: {exc}"

    async def go() -> list[str]:
        tasks = [asyncio.create_task(stream(i)) for i in range(8)]
        await asyncio.sleep(1.0)
        os.kill(decode_pids["decode-0"], signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    outcomes = asyncio.run(go())
    assert outcomes == ["completed"] * 8  # its streams moved to decode-1 (--max-migrations)
    # every surviving worker ends with nothing reserved
    deadline = time.monotonic() + 20
    while True:
        loads = cluster.loads()
        left = {a: x.num_total_blocks - x.num_free_blocks for a, x in loads.items()}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(left.values()), left
    # the dead worker drops out of the registry; new requests go to the survivor
    deadline = time.monotonic() + 30
    while len([w for w in cluster.workers("decode")]) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert asyncio.run(_complete_all(cluster.url, TEXTS, max_tokens=20, temperature=0)) == expected


def test_cancellation_in_redis_reaches_the_workers(cluster):
    import grpc

    from pdserve import SamplingParams
    from pdserve.cluster.convert import sampling_params_to_pb
    from pdserve.cluster.state import RequestStore, connect
    from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    async def cancel(request_id: str) -> None:
        client = connect(cluster.redis_url)
        try:
            await RequestStore(client).cancel(request_id)
        finally:
            await client.aclose()

    decode = cluster.workers("decode")[0]
    params = sampling_params_to_pb(SamplingParams(temperature=0, ignore_eos=True), 400)
    with grpc.insecure_channel(decode.address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        asyncio.run(cancel("cancelled-early"))  # the flag: refused on arrival
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(decode_pb2.GenerateRequest(
                request_id="cancelled-early", prompt_token_ids=[5, 6, 7], params=params,
                prefill_locally=True), timeout=30))
        assert err.value.code() == grpc.StatusCode.CANCELLED
        # a reservation for a split request: the flag, read beside it, frees what it reserved
        asyncio.run(cancel("cancelled-early-split"))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(decode_pb2.GenerateRequest(
                request_id="cancelled-early-split", prompt_token_ids=[5, 6, 7] * 20,
                params=params), timeout=30))
        assert err.value.code() == grpc.StatusCode.CANCELLED
        stream = stub.Generate(decode_pb2.GenerateRequest(
            request_id="cancelled-later", prompt_token_ids=[5, 6, 7], params=params,
            prefill_locally=True), timeout=60)
        next(stream)
        asyncio.run(cancel("cancelled-later"))  # the message: aborts what is running
        rest = list(stream)
        assert sum(len(m.token_ids) for m in rest) < 399
        assert rest[-1].finish_reason == "abort"
    prefill = cluster.workers("prefill")[0]
    with grpc.insecure_channel(prefill.address) as ch:  # a prefill: computed, then undone
        asyncio.run(cancel("cancelled-early-prefill"))
        with pytest.raises(grpc.RpcError) as err:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="cancelled-early-prefill", prompt_token_ids=[5, 6, 7] * 20,
                params=params, decode_address=decode.address), timeout=30)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 10
    while any(cluster.loads()[w.address].num_free_blocks != cluster.loads()[
            w.address].num_total_blocks for w in (decode, prefill)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
