"""Start a real `pdserve up` cluster (separate processes, loopback) for the tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.registry import WorkerInfo
from pdserve.ports import free_port


@dataclass
class Cluster:
    url: str
    redis_url: str
    proc: subprocess.Popen
    log: Path
    cluster_file: Path

    def pids(self) -> dict[str, int]:
        return json.loads(self.cluster_file.read_text())["pids"]

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        from pdserve.cluster.registry import WorkerRegistry
        from pdserve.cluster.state import connect

        async def go() -> list[WorkerInfo]:
            client = connect(self.redis_url)
            try:
                return await WorkerRegistry(client).list_workers(role)
            finally:
                await client.aclose()

        return asyncio.run(go())

    def loads(self) -> dict[str, object]:
        """Live load of every registered worker, straight from its GetLoad rpc."""
        import grpc

        from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

        stubs = {"decode": decode_pb2_grpc.DecodeStub, "prefill": prefill_pb2_grpc.PrefillStub}
        out = {}
        for w in self.workers():
            if w.role not in stubs:
                continue
            with grpc.insecure_channel(w.address) as ch:
                try:
                    out[w.address] = stubs[w.role](ch).GetLoad(common_pb2.GetLoadRequest(),
                                                                timeout=5)
                except grpc.RpcError as exc:  # killed, not yet out of the registry
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
        return out


@contextmanager
def run_cluster(
    tmp: Path, *args: str, timeout_s: float = 240.0, env: dict[str, str] | None = None
) -> Iterator[Cluster]:
    """`pdserve up ARGS` on a free port; yields once the gateway is ready; stops it after.
    `env` reaches every service (PDSERVE_<FLAG> sets a flag `pdserve up` does not pass on)."""
    port = free_port()
    log = tmp / f"cluster-{port}.log"
    cluster_file = tmp / f"cluster-{port}.json"
    env = {**os.environ, **(env or {}), "PDSERVE_CLUSTER_FILE": str(cluster_file)}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, cluster_file, log, timeout_s)
        redis_url = json.loads(cluster_file.read_text())["redis_url"]
        yield Cluster(url, redis_url, proc, log, cluster_file)
    finally:
        proc.send_signal(signal.SIGTERM)  # SIGINT is ignored by background jobs of a script
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, cluster_file: Path, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if cluster_file.exists():
            return
        time.sleep(0.5)
    raise TimeoutError(f"pdserve up not ready in {timeout_s} s:\n{log.read_text()[-4000:]}")


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening (yet)
        return 0, str(e)


@contextmanager
def extra_gateway(cluster: Cluster, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """Another gateway on the cluster's Redis (gateways keep no state of their own): its URL
    once ready, and its process; SIGTERMed at the end if still running."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "gateway", "--port", str(port), "--redis-url",
         cluster.redis_url, "--log-level", "warning", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while http_get(url + "/ready")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
