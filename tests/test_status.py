"""`pdserve status`'s table (pure: no cluster): one row per worker, its prefix cache's blocks,
its KV transport and tensor-parallel size last."""

from __future__ import annotations

from dataclasses import asdict

from pdserve.cluster.registry import WorkerInfo
from pdserve.status import render


def test_table_shows_each_workers_cached_blocks_kv_transport_and_tp_size() -> None:
    workers = [asdict(w) for w in (
        WorkerInfo("d0", "decode", "10.0.0.2:50061", num_running=3, num_free_blocks=7,
                   num_total_blocks=11, kv_transport="cuda_ipc", tensor_parallel_size=2,
                   num_cached_blocks=6),
        WorkerInfo("p0", "prefill", "10.0.0.1:50071", num_waiting=2, num_free_blocks=11,
                   num_total_blocks=11, kv_transport="auto", tensor_parallel_size=1,
                   num_cached_blocks=9),
        WorkerInfo("t0", "tokenizer", "10.0.0.3:50051"),
    )]
    # The colocated engine, as gateway/local_backend.py lists it: no kv_transport key at all.
    colocated = {"worker_id": "colocated", "role": "colocated", "address": "in-process",
           "num_running": 0, "num_waiting": 0, "num_free_blocks": 5, "num_total_blocks": 5}
    assert render([*workers, colocated]).splitlines() == [
        "ROLE       ADDRESS         RUNNING  WAITING  KV BLOCKS USED/TOTAL  CACHED  TRANSPORT  TP",
        "decode     10.0.0.2:50061  3        0        4/11                  6       cuda_ipc   2",
        "prefill    10.0.0.1:50071  0        2        0/11                  9       auto       1",
        "tokenizer  10.0.0.3:50051  0        0        -                     -       -          -",
        "colocated  in-process      0        0        0/5                   0       -          -",
    ]
