"""The decode worker's grant of its reserved blocks, through the whole pipeline over a data plane.

`pdserve up --kv-transport nixl` (host memory; 2 prefill workers, 1 decode worker, the tiny
model, kv_aware routing: a prompt sent before goes to the worker holding its blocks, so the
router's pick is known from Redis): the gateway hands Generate's grant to
the first prefill attempt, whose push writes into the blocks without a KVTarget rpc; a prefill
retried on another worker gets no grant (it asks KVTarget, superseding the lost worker's push).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

import openai
import pytest
from cluster import Cluster, http_get, run_cluster
from test_cluster_kv_routing import BLOCK, _holders, _until
from test_worker_faults import _assert_no_blocks_held, _metric, _pid_of

from pdserve.transport.base import nixl_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")]

PROMPTS = [list(range(100, 160)), list(range(300, 340))]  # token ids: 3 and 2 full blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("kv_grant")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--prefill", "2", "--decode", "1",
                     "--kv-transport", "nixl",
                     "--kv-cache-memory", str(4 << 20), "--dtype", "float32") as c:
        yield c


async def _complete(c: Cluster, prompt: list[int]) -> str:
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
    out = await client.completions.create(model=None, prompt=prompt, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def _worker_counter(c: Cluster, role: str, name: str, **labels: str) -> float:
    """`pdserve:{name}_total` summed over the workers of `role` (their /metrics pages)."""
    return sum(_counter(w.metrics_address, name, **labels) for w in c.workers(role))


def _counter(metrics_address: str, name: str, **labels: str) -> float:
    _, text = http_get(f"http://{metrics_address}/metrics")
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^pdserve:{name}_total{{(.*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_the_first_prefill_writes_into_the_granted_blocks(cluster):
    """The first push to the decode worker describes it (no grant yet: nothing exported); every
    later one writes into the blocks its Generate granted. All KV goes over nixl, and the
    pushes ring the decode worker's commit doorbell (both on this host): its engine commits
    them ahead of their commit chunks (all but one that lost the race would do)."""
    rung = _worker_counter(cluster, "decode", "kv_transfer_doorbell_commits")
    first = asyncio.run(_complete(cluster, PROMPTS[0]))
    granted = _worker_counter(cluster, "prefill", "kv_transfer_granted_pushes")
    grpc_bytes = _worker_counter(cluster, "decode", "kv_transfer_bytes", transport="grpc")
    assert asyncio.run(_complete(cluster, PROMPTS[0])) == first
    assert asyncio.run(_complete(cluster, PROMPTS[1]))
    assert _worker_counter(cluster, "prefill", "kv_transfer_granted_pushes") == granted + 2
    assert _worker_counter(cluster, "decode", "kv_transfer_bytes", transport="grpc") == grpc_bytes
    assert _worker_counter(cluster, "decode", "kv_transfer_bytes", transport="nixl") > 0
    assert _worker_counter(cluster, "decode", "kv_transfer_doorbell_commits") >= rung + 1
    _assert_no_blocks_held(cluster)


def test_a_retried_prefill_gets_no_grant_and_still_answers(cluster):
    """The router's prefill worker (the one holding the prompt's blocks) is frozen, sent the
    request (with the grant), then killed: the gateway retries on the other worker without the
    grant (its push asks KVTarget), and the answer equals the same request served undisturbed."""
    def holders() -> list:  # of PROMPTS[1]'s full blocks, as Redis says
        held = _holders(cluster, PROMPTS[1])
        return [w for w in cluster.workers("prefill")
                if held[w.worker_id] == len(PROMPTS[1]) // BLOCK]

    victim, = _until(holders)  # the earlier test's PROMPTS[1]: its blocks' events
    expected = asyncio.run(_complete(cluster, PROMPTS[1]))  # served by the holder: a hit
    assert holders() == [victim]
    pid = _pid_of(cluster, victim.address)
    retries = _metric(cluster, "pdserve:prefill_retries")
    survivor = next(w for w in cluster.workers("prefill") if w.address != victim.address)
    granted = _counter(survivor.metrics_address, "kv_transfer_granted_pushes")
    pushed = _counter(survivor.metrics_address, "kv_transfer_bytes", transport="nixl")

    async def go() -> str:
        os.kill(pid, signal.SIGSTOP)
        task = asyncio.create_task(_complete(cluster, PROMPTS[1]))
        await asyncio.sleep(1.5)  # the Prefill call now waits on the frozen worker
        assert not task.done()
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(task, timeout=60)

    assert asyncio.run(go()) == expected
    assert _metric(cluster, "pdserve:prefill_retries") == retries + 1
    # the survivor pushed the retried request over nixl, into blocks KVTarget gave it
    assert _counter(survivor.metrics_address, "kv_transfer_bytes", transport="nixl") > pushed
    assert _counter(survivor.metrics_address, "kv_transfer_granted_pushes") == granted
    _assert_no_blocks_held(cluster)
