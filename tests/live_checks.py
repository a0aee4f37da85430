"""What the reliability tests read from a live cluster (tests/cluster.py) to say nothing leaked:
each worker's load (GetLoad), the gateway's and workers' Prometheus counters, every request's
state in Redis, and a process's resident memory."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cluster import Cluster, http_get
from prometheus_client.parser import text_string_to_metric_families


def leftovers(cluster: Cluster) -> dict[str, tuple[int, int, int]]:
    """(running, waiting, blocks in use) of every prefill and decode worker. A block in use is
    one no allocation could take: free blocks include prefix-cached ones nobody holds."""
    return {address: (load.num_running, load.num_waiting,
                      load.num_total_blocks - load.num_free_blocks)
            for address, load in cluster.loads().items()}


def wait_idle(cluster: Cluster, timeout_s: float) -> dict[str, tuple[int, int, int]]:
    """Until every worker runs, queues and holds nothing; the last reading (all zeros unless
    `timeout_s` ran out first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = leftovers(cluster)
        if not any(any(x) for x in left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def metric(url: str, name: str) -> float:
    """The sum of every sample of `name` (labels summed over) on the Prometheus page `url`."""
    status, text = http_get(url)
    assert status == 200, (url, status)
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


def worker_metrics_url(cluster: Cluster, role: str) -> str:
    (worker,) = cluster.workers(role)
    return f"http://{worker.metrics_address}/metrics"


def request_states(redis_url: str) -> dict[str, dict[str, str]]:
    """Every request's state record in the cluster's Redis, by request id."""
    from pdserve.cluster.state import Keys, RequestStore, connect

    async def go() -> dict[str, dict[str, str]]:
        client = connect(redis_url)
        store, prefix = RequestStore(client), Keys().request("")
        try:
            ids = [key.removeprefix(prefix) async for key in client.scan_iter(prefix + "*")]
            return {rid: await store.get(rid) or {} for rid in ids}
        finally:
            await client.aclose()

    return asyncio.run(go())


def furthest_phase(state: dict[str, str]) -> str:
    """The last phase a request reached before it ended (its `ts_<phase>` fields)."""
    phases = ("queued", "prefilling", "transferring", "decoding")
    return [p for p in phases if f"ts_{p}" in state][-1]


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for pid {pid}")
