"""`pdserve status`: every registered worker with its role, address, load, prefix-cache blocks, KV
transport, tensor-parallel size and LoRA adapters."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from dataclasses import asdict

from pdserve.cluster.flags import add_flag, add_redis_namespace_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--redis-url", "", help="the cluster's Redis (default: the one `pdserve up` runs)")
    add_redis_namespace_flag(p)
    add_flag(p, "--gateway", "", help="ask this gateway (http://host:port) instead of Redis")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def fetch(args: argparse.Namespace) -> list[dict]:
    if args.gateway:
        with urllib.request.urlopen(args.gateway.rstrip("/") + "/workers", timeout=5) as r:
            return json.loads(r.read())["workers"]
    url = args.redis_url or _local_cluster_redis()
    return asyncio.run(_from_redis(url, args.redis_namespace))


def _local_cluster_redis() -> str:
    from pdserve.launcher import cluster_file

    path = cluster_file()
    if not path.exists():
        raise SystemExit("pdserve status: no local cluster found (is `pdserve up` running?); "
                         "pass --redis-url or --gateway")
    url = json.loads(path.read_text()).get("redis_url")
    if not url:
        raise SystemExit("pdserve status: the local cluster is colocated: it has no workers")
    return url


async def _from_redis(url: str, namespace: str) -> list[dict]:
    from pdserve.cluster.registry import WorkerRegistry
    from pdserve.cluster.state import connect

    client = connect(url)
    try:
        return [asdict(w) for w in await WorkerRegistry(client, prefix=namespace).list_workers()]
    finally:
        await client.aclose()


def render(workers: list[dict]) -> str:
    """One row per worker. CACHED counts the blocks in its prefix cache (what KV-aware routing
    can hit), TRANSPORT is its --kv-transport and TP its --tensor-parallel-size:
    "-" for a tokenizer, the colocated engine, or a worker (or gateway, with --gateway) too old
    to publish them. LORAS lists the LoRA adapters it holds ("-": none), a column shown once
    any worker holds one."""
    loras = any(w.get("lora_adapters") for w in workers)
    rows = [("ROLE", "ADDRESS", "RUNNING", "WAITING", "KV BLOCKS USED/TOTAL", "CACHED",
             "TRANSPORT", "TP", *(["LORAS"] if loras else []))]
    for w in workers:
        total = w["num_total_blocks"]
        used = f"{total - w['num_free_blocks']}/{total}" if total else "-"
        cached = str(w.get("num_cached_blocks", 0)) if total else "-"
        rows.append((w["role"], w["address"], str(w["num_running"]), str(w["num_waiting"]), used,
                     cached, w.get("kv_transport") or "-",
                     str(w.get("tensor_parallel_size") or "-"),
                     *([",".join(w.get("lora_adapters") or []) or "-"] if loras else [])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    workers = fetch(args)
    if args.json:
        json.dump({"workers": workers}, sys.stdout, indent=2)
        print()
    else:
        print(render(workers) if workers else "no workers registered")
    return 0
