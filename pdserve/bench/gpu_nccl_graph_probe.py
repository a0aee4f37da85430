"""Can a CUDA graph hold a `TPGroup` NCCL all-reduce? Two processes, one GPU each (needs 2).

    python pdserve/bench/gpu_nccl_graph_probe.py global|thread_local|relaxed|steps

Each rank joins a `TPGroup` (engine/distributed/group.py) on its own GPU, runs one all-reduce
eagerly (NCCL's communicator starts), then captures `y = all_reduce(x * 2); z = y + 1` in the
given capture error mode and replays it three times on new inputs; rank r's x is r + 1 + i on
replay i, so after the last replay z = 2 * (3 + 4) + 1 = 15 on both ranks. Prints each rank's
("ok", z) or its error, then the ranks' exit codes (None: still alive, as they should be until
the parent kills them: a group's abort can take its whole timeout).

`steps` follows a tensor-parallel engine's step pattern instead, `STEPS` times: replay a graph
of two all-reduces over [64, 4096] bf16 (a decode step's), then eagerly gather the logits'
halves to rank 0 and broadcast rank 0's argmax ids (the sampled tokens), with an eager
all-reduce over [16384, 4096] (a prefill chunk's) every 50 steps. Prints ("ok", steps, ms per
step, the sum of every id broadcast) per rank: the sums must be equal; a hang (no result within
40 s) would be NCCL mixing replays with eager collectives, not the engine's bookkeeping.
"""

from __future__ import annotations

import datetime
import socket
import sys
import time
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed.group import TPGroup

TIMEOUT_S = 30.0


STEPS = 500


def rank_main(rank: int, port: int, mode: str, results: Queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = TPGroup(rank, 2, store, device, TIMEOUT_S)
    group.all_reduce(torch.full((1024,), float(rank + 1), device=device))
    torch.cuda.synchronize()
    if mode == "steps":
        results.put((rank, mode, *engine_steps(group, device)))
        time.sleep(60)
        return
    x = torch.full((1024,), float(rank + 1), device=device)  # the graph's static input
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):
            y = group.all_reduce(x * 2)
            z = y + 1
        torch.cuda.synchronize()
        for i in range(3):
            x.fill_(rank + 1 + i)
            graph.replay()
        torch.cuda.synchronize()
        results.put((rank, mode, "ok", float(z[0])))
    except Exception as exc:  # reported, not raised: the parent prints both ranks' outcomes
        results.put((rank, mode, "error", repr(exc)[:300]))
    time.sleep(60)  # the parent kills this rank once it has both results


def engine_steps(group: TPGroup, device: torch.device) -> tuple:
    """`STEPS` decode steps as a TP=2 engine runs them (the module's NOTE): (outcome, steps, ms
    per step, the sum of the ids broadcast)."""
    hidden = torch.randn(64, 4096, dtype=torch.bfloat16, device=device)
    head = torch.randn(16000, 4096, dtype=torch.bfloat16, device=device) / 64  # vocab half
    prefill = torch.randn(16384, 4096, dtype=torch.bfloat16, device=device)
    for _ in range(2):  # warm-up, eagerly
        group.all_reduce(group.all_reduce(hidden * 0.5))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = group.all_reduce(group.all_reduce(hidden * 0.5) * 0.5)
    checksum, start = 0, time.perf_counter()
    try:
        for step in range(STEPS):
            graph.replay()
            logits = group.gather_last_dim(out @ head.t())  # rank 0: [64, 32000]
            ids = logits.argmax(-1) if group.rank == 0 else torch.empty(
                64, dtype=torch.int64, device=device)
            got = group.broadcast(ids)
            if step % 50 == 49:
                group.all_reduce(prefill)
                prefill.mul_(0.5)
            checksum += int(got.sum())  # the host waits for the step's tokens, as the engine
    except Exception as exc:
        return ("error", repr(exc)[:300])
    ms = 1000 * (time.perf_counter() - start) / STEPS
    return ("ok", STEPS, round(ms, 3), checksum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(mode: str) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, mode, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            print("RESULT", results.get(timeout=40), flush=True)
    except Exception as exc:
        print("RESULT missing", repr(exc), flush=True)
    print("exitcodes", [p.exitcode for p in procs], flush=True)
    for p in procs:
        p.kill()


if __name__ == "__main__":
    main(sys.argv[1])
