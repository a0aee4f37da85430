"""KV-aware routing in a running cluster (`pdserve up --prefill 2 --decode 2`, tiny model, real
Redis): the workers publish their prefix caches into Redis, a follow-up turn goes to the prefill
worker holding its history (asserted from the gateway's routing metrics and that worker's
prefix-cache hits) and to the decode worker holding it, which is pushed only the new blocks
(decode-side reuse, asserted in bytes); an unrelated prompt is routed by load, and an evicted
prefix stops attracting requests."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from cluster import run_cluster
from live_checks import metric
from test_worker_faults import _pid_of

from engine.block_manager import prefix_hashes
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.state import connect

pytestmark = pytest.mark.slow
BLOCK = 16


def _complete(url: str, token_ids: list[int]) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"prompt": token_ids, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def _chat(url: str, messages: list[dict]) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _tokenize(url: str, messages: list[dict]) -> list[int]:
    """The conversation's ids as a chat request's prompt (add_generation_prompt)."""
    r = httpx.post(f"{url}/tokenize", timeout=60, json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _holders(c, token_ids: list[int], role: str = "prefill") -> dict[str, int]:
    """Per worker of `role`, the leading blocks of `token_ids` Redis says it holds."""
    ids = [w.worker_id for w in c.workers(role)]

    async def go() -> dict[str, int]:
        client = connect(c.redis_url)
        try:
            return await PrefixIndex(client).leading_hits(ids, prefix_hashes(token_ids, BLOCK))
        finally:
            await client.aclose()

    return asyncio.run(go())


def _until(fn, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := fn():
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


def _labelled(c, reason: str, role: str = "prefill") -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{c.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdserve:routing_decisions_total"
               and s.labels == {"role": role, "reason": reason})


def _decode_sum(c, name: str) -> float:
    """`name` summed over the decode workers' /metrics pages."""
    return sum(metric(f"http://{w.metrics_address}/metrics", name) for w in c.workers("decode"))


def test_a_follow_up_turn_goes_to_the_worker_holding_its_history(tiny_llama_dir, tmp_path):
    # 40 KV blocks of 16 tokens per worker: enough for a 512-token context, few enough to evict
    with run_cluster(tmp_path, "--model", tiny_llama_dir, "--prefill", "2", "--decode", "2",
                     "--kv-cache-memory", str(40 * 8192), "--dtype", "float32") as c:
        turn1 = list(range(1000, 1200))  # 12 full blocks
        _complete(c.url, turn1)
        holders = _until(lambda: {w: n for w, n in _holders(c, turn1).items() if n} or None)
        assert list(holders.values()) == [12]
        (holder,) = holders
        metrics = {w.worker_id: f"http://{w.metrics_address}/metrics" for w in c.workers("prefill")}
        hits_before = metric(metrics[holder], "pdserve:prefix_cache_hits_total")
        assert _labelled(c, "prefix_hit") == 0
        bytes1 = _until(lambda: _decode_sum(c, "pdserve:kv_transfer_bytes_total"))
        assert bytes1 % 13 == 0  # 200 tokens: 13 blocks pushed
        _until(lambda: any(_holders(c, turn1, "decode").values()))  # the decode worker's too

        _complete(c.url, turn1 + list(range(3000, 3040)))  # the next turn: history + 40 tokens
        assert _labelled(c, "prefix_hit") == 1 and _labelled(c, "prefix_hit", "decode") == 1
        # the worker's counters are its last heartbeat's snapshot
        _until(lambda: metric(metrics[holder], "pdserve:prefix_cache_hits_total")
               - hits_before == 192)
        # the decode worker held turn 1's 12 full blocks (it computed the first answer token
        # after them): of the 15 blocks of 240 tokens only the last 3 were pushed
        _until(lambda: _decode_sum(c, "pdserve:kv_transfer_skipped_blocks_total") == 12)
        assert _decode_sum(c, "pdserve:kv_transfer_bytes_total") - bytes1 == bytes1 // 13 * 3

        loads = _labelled(c, "load")
        _complete(c.url, list(range(5000, 5100)))  # unrelated: by load
        assert _labelled(c, "load") == loads + 1

        # a small shared prefix (1 block of 10) pulls a request to the holder only while it is
        # not busy: the holder frozen, the first such request waits there, and the next one,
        # sent while the first is in flight, goes to the other worker by load
        _until(lambda: all(w.num_running + w.num_waiting == 0  # what the router reads
                           for w in c.workers("prefill")))
        hits, loads = _labelled(c, "prefix_hit"), _labelled(c, "load")
        small = [turn1[:BLOCK] + list(range(7000 + 200 * i, 7144 + 200 * i)) for i in range(2)]
        pid = _pid_of(c, next(w.address for w in c.workers("prefill") if w.worker_id == holder))

        async def busy_holder() -> None:
            os.kill(pid, signal.SIGSTOP)
            try:
                tasks = []
                for ids in small:
                    tasks.append(asyncio.create_task(asyncio.to_thread(_complete, c.url, ids)))
                    await asyncio.sleep(0.3)
            finally:
                os.kill(pid, signal.SIGCONT)
            await asyncio.gather(*tasks)

        asyncio.run(busy_holder())
        assert (_labelled(c, "prefix_hit"), _labelled(c, "load")) == (hits + 1, loads + 1)

        # fill the caches with other prompts (routed to either worker) until the history is
        # evicted everywhere
        for k in range(30):
            _complete(c.url, list(range(10000 + 500 * k, 10000 + 500 * k + 400)))
            if k >= 5 and not any(_holders(c, turn1).values()):
                break
        _until(lambda: not any(_holders(c, turn1).values()))
        hits = _labelled(c, "prefix_hit")
        _complete(c.url, turn1 + [7])
        assert _labelled(c, "prefix_hit") == hits  # nothing attracts it any more

        # a chat's second turn, rendered by the chat template around the first turn and its
        # reply, starts with the first turn's full blocks: the gateway hashes the ids the
        # workers computed, so it finds their holder
        chat = [{"role": "user", "content": "Tell me about the sea, the tides and the moon. " * 6}]
        reply = _chat(c.url, chat)
        first = _tokenize(c.url, chat)
        _until(lambda: any(_holders(c, first).values()))
        hits = _labelled(c, "prefix_hit")
        chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
        assert _tokenize(c.url, chat)[:len(first) // BLOCK * BLOCK] == \
            first[:len(first) // BLOCK * BLOCK]
        _chat(c.url, chat)
        assert _labelled(c, "prefix_hit") == hits + 1
