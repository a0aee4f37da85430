"""Redis behind a password and over TLS (real redis-servers: `requirepass`, `--tls-port`), and
`--redis-namespace` carrying two clusters on one Redis that never see each other's workers or
cancellations."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from redis_server import RedisTLS, run_redis_server
from tls_certs import make_certs

from engine.scheduler_output import SchedulerStats
from pdserve.cluster.cancel import CancelWatch, RequestCancelled
from pdserve.cluster.registry import WorkerInfo, WorkerRegistry
from pdserve.cluster.state import RequestStore, StateStoreError, connect, redis_ok
from pdserve.cluster.worker import WorkerMonitor, add_worker_flags, start_monitoring

PASSWORD = "s3cr:et/@pw"  # characters a URL must escape


async def test_password_protected_redis() -> None:
    with run_redis_server(password=PASSWORD) as url:
        assert url.startswith("redis://:s3cr%3Aet%2F%40pw@")
        store = RequestStore(connect(url))
        await store.create("r1", model="m", prompt_tokens=3, stream=False)
        assert (await store.get("r1"))["status"] == "queued"  # type: ignore[index]
        assert await redis_ok(store.client)
        anonymous = url.replace("redis://:s3cr%3Aet%2F%40pw@", "redis://")
        wrong = url.replace("s3cr", "wrong")
        for bad in (anonymous, wrong):
            client = connect(bad)
            assert not await redis_ok(client)
            with pytest.raises(StateStoreError):
                await RequestStore(client).get("r1")


async def test_tls_redis(tmp_path: Any) -> None:
    certs = make_certs(tmp_path)
    tls = RedisTLS(certs.server_cert, certs.server_key, certs.ca)
    with run_redis_server(password="pw", tls=tls) as url:
        assert url.startswith("rediss://:pw@127.0.0.1:")
        registry = WorkerRegistry(connect(url))
        await registry.register(WorkerInfo("d0", "decode", "127.0.0.1:1"))
        assert [w.worker_id for w in await registry.list_workers()] == ["d0"]
        plaintext = connect(url.replace("rediss://", "redis://").split("?")[0], timeout_s=1)
        assert not await redis_ok(plaintext)


class _IdleEngine:
    async def stats(self) -> SchedulerStats:
        return SchedulerStats(0, 0, 8, 8, 0.0, 0, 0, 0)


def _worker_args(redis_url: str, namespace: str | None, monkeypatch: Any) -> argparse.Namespace:
    """A decode worker's parsed flags, the namespace from the environment as in the chart."""
    monkeypatch.delenv("PDSERVE_REDIS_NAMESPACE", raising=False)
    if namespace is not None:
        monkeypatch.setenv("PDSERVE_REDIS_NAMESPACE", namespace)
    parser = argparse.ArgumentParser()
    add_worker_flags(parser, 50061)
    return parser.parse_args(["--redis-url", redis_url])


async def test_namespaces_separate_clusters_on_one_redis(redis_url: str, monkeypatch) -> None:
    blue = _worker_args(redis_url, "blue", monkeypatch)
    default = _worker_args(redis_url, None, monkeypatch)
    assert (blue.redis_namespace, default.redis_namespace) == ("blue", "pdserve")
    monitor = WorkerMonitor("decode", "10.0.0.1:50061", _IdleEngine())  # type: ignore[arg-type]
    heartbeat = await start_monitoring(blue, monitor)
    assert heartbeat is not None
    client = connect(redis_url)
    try:
        await heartbeat.beat()
        blue_workers = await WorkerRegistry(client, prefix="blue").list_workers()
        assert [w.address for w in blue_workers] == ["10.0.0.1:50061"]
        assert await WorkerRegistry(client).list_workers() == []
        await _cancellations_stay_in_their_namespace(redis_url)
    finally:
        await heartbeat.stop()
    assert await WorkerRegistry(client, prefix="blue").list_workers() == []


async def _cancellations_stay_in_their_namespace(redis_url: str) -> None:
    seen: dict[str, list[str]] = {"blue": [], "green": []}
    watches = [CancelWatch(redis_url, _record(seen[ns]), ns) for ns in ("blue", "green")]
    for watch in watches:
        watch.start()
    try:
        await asyncio.sleep(0.3)  # both subscribed
        await RequestStore(connect(redis_url), prefix="blue").cancel("req-1")
        for _ in range(100):
            if seen["blue"]:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert seen == {"blue": ["req-1"], "green": []}
        await watches[0].check("req-2")
        with pytest.raises(RequestCancelled):
            await watches[0].check("req-1")
        await watches[1].check("req-1")  # green has no such flag
    finally:
        for watch in watches:
            await watch.stop()


def _record(into: list[str]) -> Any:
    async def on_cancel(request_id: str) -> None:
        into.append(request_id)

    return on_cancel


def test_status_and_gateway_take_the_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.server import add_arguments as gateway_arguments
    from pdserve.status import add_arguments as status_arguments

    monkeypatch.setenv("PDSERVE_REDIS_NAMESPACE", "blue")
    for add in (gateway_arguments, status_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        assert parser.parse_args([]).redis_namespace == "blue"
