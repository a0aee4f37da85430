"""200 streamed requests whose clients go away at random moments leave nothing behind.

A live `pdserve up` cluster (tiny random Llama, 1 prefill + 1 decode worker). Each client, from
a seeded random draw, hangs up at one of four moments:

    body      mid-upload: the request body is cut off (a raw socket, closed)
    early     before the first token: a timer closes the connection
    first     right after the first token: the KV is on its way to the decode worker
    decode    after 2-30 chunks of a completion that fills the context (ignore_eos: it cannot
              finish first)

Afterwards every worker runs, queues and holds nothing (GetLoad: zero blocks in use, prefix
cache aside), the gateway has nothing in flight, and every request the gateway admitted has
its Redis state `cancelled`, recorded within CANCEL_LAG_S of its hang-up (not when its
completion ran out). The prefill worker's KV lease is set far beyond the test, so that a leak
is caught rather than quietly freed by the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from cluster import run_cluster
from live_checks import (
    furthest_phase,
    metric,
    request_states,
    wait_idle,
    worker_metrics_url,
)

pytestmark = pytest.mark.slow

NUM_REQUESTS = 200
CLIENTS = 32  # requests in flight at once
MAX_MODEL_LEN = 512
MODES = ("body", "early", "first", "decode")
SEED = 7
CANCEL_LAG_S = 4.0  # seconds; a hang-up heard only when its completion ends comes much later


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("disconnects")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--dtype", "float32", "--kv-cache-memory",
                     str(16 << 20), "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
                     env={"PDSERVE_KV_LEASE_SECONDS": "3600"}) as c:
        yield c


@dataclass
class Outcome:
    mode: str
    chunks: int = 0  # SSE data events read before hanging up
    request_id: str = ""  # from the response's X-Request-Id, once it came
    status: int = 0  # HTTP status, once it came
    finished: bool = False  # the stream ran to [DONE]: the client failed to hang up in time
    hung_up_at: float = 0.0  # time.time() when the client closed the connection


def _body(rng: random.Random) -> dict:
    prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(4, 200))]
    # the longest completion there is: a hang-up that goes unheard costs seconds of decoding
    max_tokens = MAX_MODEL_LEN - len(prompt)
    return {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}


async def _hang_up_mid_body(url: httpx.URL, body: bytes, rng: random.Random) -> Outcome:
    reader, writer = await asyncio.open_connection(url.host, url.port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    writer.write(head.encode() + body[:rng.randrange(len(body))])
    await writer.drain()
    await asyncio.sleep(rng.uniform(0.0, 0.2))
    writer.close()
    await writer.wait_closed()
    return Outcome("body")


async def _stream_until(http: httpx.AsyncClient, body: dict, out: Outcome, chunks: int) -> None:
    """Read the stream until `chunks` data events have come, then hang up (leaving the block
    closes the connection: the body is unread)."""
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            out.status, out.request_id = r.status_code, r.headers.get("x-request-id", "")
            if r.status_code != 200:
                return
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    if line == "data: [DONE]":
                        out.finished = True
                        return
                    out.chunks += 1
                    if out.chunks >= chunks:
                        return
    finally:
        out.hung_up_at = time.time()


async def _one(http: httpx.AsyncClient, rng: random.Random) -> Outcome:
    mode, body = rng.choice(MODES), _body(rng)
    if mode == "body":
        return await _hang_up_mid_body(http.base_url, json.dumps(body).encode(), rng)
    out = Outcome(mode)
    chunks = {"early": 1, "first": 1, "decode": rng.randint(2, 30)}[mode]
    work = _stream_until(http, body, out, chunks)
    if mode == "early":
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(work, timeout=rng.uniform(0.0, 0.5))
    else:
        await work
    return out


async def _run_all(url: str) -> list[Outcome]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
        slots = asyncio.Semaphore(CLIENTS)

        async def one(i: int) -> Outcome:
            async with slots:
                return await _one(http, random.Random(SEED * 1000 + i))

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


def test_clients_that_hang_up_at_random_leave_nothing_behind(cluster):
    outcomes = asyncio.run(asyncio.wait_for(_run_all(cluster.url), timeout=90))
    assert not [o for o in outcomes if o.finished], "a stream finished before its hang-up"
    assert not [o for o in outcomes if o.status not in (0, 200)], "a request failed"
    modes = Counter(o.mode for o in outcomes)
    assert all(modes[m] >= 30 for m in MODES), modes

    left = wait_idle(cluster, timeout_s=10)
    assert not any(any(x) for x in left.values()), f"(running, waiting, blocks) left: {left}"
    assert metric(cluster.url + "/metrics", "pdserve:num_requests_running") == 0
    assert metric(worker_metrics_url(cluster, "prefill"), "pdserve:kv_lease_expired_total") == 0

    states = request_states(cluster.redis_url)
    assert {s["status"] for s in states.values()} == {"cancelled"}, Counter(
        s["status"] for s in states.values())
    seen = {o.request_id: o.hung_up_at for o in outcomes if o.request_id}
    assert set(seen) <= set(states)  # every request whose id the client saw is recorded
    # ... and cancelled at once, not once its completion ran out (a hang-up went unheard)
    lag = max(float(states[rid]["ts_cancelled"]) - t for rid, t in seen.items())
    assert lag < CANCEL_LAG_S, f"a request was cancelled {lag:.1f} s after its client left"
    phases = Counter(furthest_phase(s) for s in states.values())
    assert phases["transferring"] > 0 and phases["decoding"] > 0, phases
    print(f"\n{NUM_REQUESTS} hang-ups: client side {dict(modes)}; {len(states)} admitted, "
          f"cancelled at most {lag:.2f} s after the hang-up, "
          f"cancelled while {dict(phases)}; blocks left {left}")
