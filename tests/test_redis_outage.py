"""Redis restarted under a running cluster (issue 7, "Worker faults"): while it is unreachable
the gateway is not ready and answers new requests 503 with Retry-After; once it is back (empty:
nothing persisted) the heartbeats repopulate the registry and requests succeed, with nothing
restarted. Also: a worker whose engine is slow to answer keeps its registry entry alive."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from cluster import http_get, run_cluster
from redis_server import start_redis_on

from pdserve.cluster.registry import Heartbeat, WorkerInfo
from pdserve.ports import free_port


# ---- a heartbeat is never starved by a slow engine -------------------------------------------
class _Registry:
    """Records heartbeats as the registry would receive them."""

    ttl_s = 0.6

    def __init__(self) -> None:
        self.beats: list[tuple[float, int]] = []  # (time, num_running)

    async def heartbeat(self, info: WorkerInfo) -> WorkerInfo:
        self.beats.append((time.monotonic(), info.num_running))
        return info

    async def deregister(self, role: str, worker_id: str) -> None:
        pass


async def test_heartbeat_goes_on_with_the_last_info_while_the_engine_is_busy():
    registry, engine_free, calls = _Registry(), asyncio.Event(), []

    async def get_info() -> WorkerInfo:  # the engine answers between steps
        calls.append(time.monotonic())
        if len(calls) == 2:
            await engine_free.wait()  # one step of many seconds
        return WorkerInfo("prefill-a", "prefill", "a:1", num_running=len(calls))

    hb = Heartbeat(registry, get_info, interval_s=0.1)  # type: ignore[arg-type]
    hb.start()
    await asyncio.sleep(1.0)  # the engine is stuck for longer than the TTL
    stuck = list(registry.beats)
    engine_free.set()
    await asyncio.sleep(0.3)
    await hb.stop()
    gaps = [b[0] - a[0] for a, b in zip(registry.beats, registry.beats[1:])]
    assert len(stuck) >= 8 and max(gaps) < registry.ttl_s / 2
    assert {n for _, n in stuck} == {1}  # the last info known, again
    assert len(calls) >= 3  # asked again only once the slow call answered
    assert registry.beats[-1][1] == len(calls) and registry.beats[-1][1] >= 3


def test_heartbeat_interval_leaves_room_for_missed_beats():
    registry = _Registry()

    async def get_info() -> WorkerInfo:
        raise AssertionError("not called")

    with pytest.raises(ValueError, match="ttl_s / 3"):
        Heartbeat(registry, get_info, interval_s=0.25)  # type: ignore[arg-type]
    Heartbeat(registry, get_info, interval_s=0.15)  # type: ignore[arg-type]


# ---- a real Redis stopped and restarted --------------------------------------------------------
@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    port = free_port()
    workdir = str(tmp_path_factory.mktemp("redis"))
    holder = {"proc": start_redis_on(port, workdir), "dir": workdir}
    yield port, holder
    holder["proc"].kill()
    holder["proc"].wait(timeout=10)


def _until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held; TimeoutError past `timeout_s`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(what)
        time.sleep(0.1)
    return time.monotonic() - t0


def _complete(url: str, stream: bool = False) -> httpx.Response:
    body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.mark.slow
def test_redis_restart_makes_the_gateway_unready_then_everything_recovers(
    tmp_path, tiny_llama_dir, redis_port
):
    port, redis = redis_port
    with run_cluster(tmp_path, "--redis-url", f"redis://127.0.0.1:{port}/0", "--model",
                     tiny_llama_dir, "--dtype", "float32", "--kv-cache-memory", str(16 << 20),
                     "--max-model-len", "512", "--log-level", "warning") as c:
        assert _complete(c.url).status_code == 200
        redis["proc"].send_signal(signal.SIGKILL)
        redis["proc"].wait(timeout=10)
        unready_s = _until(lambda: http_get(c.url + "/ready")[0] == 503, 15.0,
                           "/ready stayed 200 with Redis down")
        for stream in (False, True):
            r = _complete(c.url, stream)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "service_unavailable"
            assert "registry unreachable" in error["message"]
        assert c.proc.poll() is None  # nothing exited
        redis["proc"] = start_redis_on(port, redis["dir"])  # empty: nothing was persisted
        ready_s = _until(lambda: http_get(c.url + "/ready")[0] == 200, 20.0,
                         "the gateway did not become ready again")
        # Each service re-registers on its next heartbeat (1 s apart, not in lockstep with the
        # gateway's readiness): wait for all three, within a few beats.
        _until(lambda: sorted(w.role for w in c.workers()) == ["decode", "prefill", "tokenizer"],
               10.0, "a service did not re-register after Redis came back")
        for stream in (False, True):
            r = _complete(c.url, stream)
            assert r.status_code == 200, r.text
        print(f"not ready {unready_s:.1f} s after Redis died; ready {ready_s:.1f} s after it "
              "came back")
