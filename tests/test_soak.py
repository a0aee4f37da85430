"""Soak: a live cluster driven past its capacity by the load generator (loadtest/) for 30 s.

`pdserve up` on loopback (tiny random Llama, 1 prefill + 1 decode worker) behind a gateway that
admits LIMIT requests in flight (--max-concurrent-requests). Streamed completions and chat
requests of mixed lengths arrive (Poisson) faster than the cluster serves them, first for a
warm-up, then for the soak proper. Afterwards:

  - every request either completed, with exactly the tokens it asked for, or got 429 at once
    (within REFUSAL_S);
    some did get 429 (the load was above capacity), none failed otherwise;
  - every worker runs, queues and holds nothing; no KV lease had to expire;
  - every admitted request's Redis state says `finished`;
  - each service's resident memory is within MEMORY_TOLERANCE of where it stood after the
    warm-up (the first seconds of serving fill allocator pools and caches for good).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from cluster import run_cluster
from live_checks import metric, request_states, rss_bytes, wait_idle, worker_metrics_url

from loadtest.client import ClientConfig, StreamClient
from loadtest.runner import RunConfig, run_rate
from loadtest.workloads import WorkloadConfig, build

pytestmark = pytest.mark.slow

LIMIT = 16  # requests in flight at the gateway
RATE = 30.0  # requests/s offered, about twice what the tiny model serves here
WARMUP_S, SOAK_S = 15.0, 30.0
CHAT_SHARE = 0.25  # of the requests
MEMORY_TOLERANCE = 0.05
REFUSAL_S = 2.0  # a 429 takes milliseconds; this leaves room for a busy 2-core box
SERVICES = ("gateway", "prefill-0", "decode-0", "tokenizer")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("soak")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--dtype", "float32", "--kv-cache-memory",
                     str(16 << 20), "--max-model-len", "512", "--log-level", "warning",
                     env={"PDSERVE_MAX_CONCURRENT_REQUESTS": str(LIMIT)}) as c:
        yield c


async def _drive(url: str, tokenizer: Any, seconds: float, seed: int) -> list[dict[str, Any]]:
    """Completions and chat at RATE for `seconds`: every request's record."""
    workload = WorkloadConfig(kind="random", input_len=(8, 256), output_len=(8, 128))
    runs = []
    for endpoint, share in (("completions", 1 - CHAT_SHARE), ("chat", CHAT_SHARE)):
        count = round(RATE * share * seconds)
        specs = build(workload, tokenizer, count, seed + len(runs))
        cfg = RunConfig(rates=(RATE * share,), num_prompts=count, num_warmups=0,
                        max_duration_s=seconds + 60, seed=seed + len(runs), progress=False)
        client = StreamClient(ClientConfig(url, endpoint=endpoint, timeout_s=60))
        runs.append(_run(client, specs, cfg))
    results = await asyncio.gather(*runs)
    for result in results:
        assert (result["timed_out"], result["not_sent"]) == (False, 0)
    return [r for result in results for r in result["requests"]]


async def _run(client: StreamClient, specs: list, cfg: RunConfig) -> dict[str, Any]:
    async with client:
        return await run_rate(client, specs, cfg.rates[0], cfg)


def _check_outcomes(records: list[dict[str, Any]]) -> Counter:
    outcomes = Counter("ok" if not r["error"] else r["error"][:8] for r in records)
    assert set(outcomes) <= {"ok", "HTTP 429"}, [r["error"] for r in records if r["error"]][:5]
    for r in records:
        if not r["error"]:
            assert r["completion_tokens"] == r["output_len"]  # ignore_eos: all it asked for
        else:  # refused at once, not after waiting for a slot
            assert r["done_at"] - r["sent_at"] < REFUSAL_S, r
    return outcomes


def _rss(cluster) -> dict[str, int]:
    pids = cluster.pids()
    return {name: rss_bytes(pids[name]) for name in SERVICES}


def test_overload_soak_fails_nothing_but_429s_and_leaks_nothing(cluster, bundled_tokenizer):
    warmup = _check_outcomes(asyncio.run(_drive(cluster.url, bundled_tokenizer, WARMUP_S, 1)))
    assert not any(any(x) for x in wait_idle(cluster, timeout_s=30).values())
    before = _rss(cluster)

    outcomes = _check_outcomes(asyncio.run(_drive(cluster.url, bundled_tokenizer, SOAK_S, 2)))
    assert outcomes["HTTP 429"] > 0 and outcomes["ok"] > outcomes["HTTP 429"] / 10, outcomes

    left = wait_idle(cluster, timeout_s=30)
    assert not any(any(x) for x in left.values()), f"(running, waiting, blocks) left: {left}"
    after = _rss(cluster)
    assert metric(cluster.url + "/metrics", "pdserve:num_requests_running") == 0
    rejected = metric(cluster.url + "/metrics", "pdserve:requests_rejected_total")
    assert rejected == warmup["HTTP 429"] + outcomes["HTTP 429"]
    assert metric(worker_metrics_url(cluster, "prefill"), "pdserve:kv_lease_expired_total") == 0
    states = Counter(s["status"] for s in request_states(cluster.redis_url).values())
    assert states == {"finished": warmup["ok"] + outcomes["ok"]}, states
    growth = {name: after[name] / before[name] - 1 for name in SERVICES}
    print(f"\nsoak: {RATE:g} req/s for {SOAK_S:g} s after {WARMUP_S:g} s warm-up: {dict(outcomes)}"
          f" (warm-up {dict(warmup)}); RSS MiB before/after: "
          + ", ".join(f"{n} {before[n] >> 20}/{after[n] >> 20}" for n in SERVICES))
    assert all(g <= MEMORY_TOLERANCE for g in growth.values()), growth
