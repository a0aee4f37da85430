"""Can a CUDA graph hold a `TPGroup` NCCL all-reduce? Two processes, one GPU each (needs 2).

    python pdserve/bench/gpu_nccl_graph_probe.py global|thread_local|relaxed|steps

Each rank joins a `TPGroup` (engine/distributed/group.py) on its own GPU, runs one all-reduce
eagerly (NCCL's communicator starts), then captures `y = all_reduce(x * 2); z = y + 1` in the
given capture error mode and replays it three times on new inputs; rank r's x is r + 1 + i on
replay i, so after the last replay z = 2 * (3 + 4) + 1 = 15 on both ranks. Prints each rank's
("ok", z) or its error, then the ranks' exit codes (None: still alive, as they should be until
the parent kills them: a group's abort can take its whole timeout).

`steps` follows a tensor-parallel engine's step pattern instead, `STEPS` times: replay one of
three graphs (batch 64, 32, 16, captured largest first into one memory pool, replayed in turn
as a shrinking batch would) of two all-reduces over [batch, 4096] bf16 (a decode step's), then
eagerly gather the logits' halves to rank 0 and broadcast rank 0's argmax ids (the sampled
tokens), with an eager all-reduce over [16384, 4096] (a prefill chunk's) every 50 steps.
Prints ("ok", steps, ms per step, the sum of every id broadcast) per rank: the sums must be
equal; a hang (no result within 40 s) would be NCCL mixing replays with eager collectives, not
the engine's bookkeeping.
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
SIZES = (64, 32, 16)  # the captured decode batch sizes, largest first


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
    graphs, outs, pool = {}, {}, torch.cuda.graph_pool_handle()
    for size in SIZES:  # largest first, one memory pool, as engine/cuda_graphs.py captures
        group.all_reduce(group.all_reduce(hidden[:size] * 0.5))  # warm-up, eagerly
        torch.cuda.synchronize()
        graphs[size] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[size], pool=pool):
            outs[size] = group.all_reduce(group.all_reduce(hidden[:size] * 0.5) * 0.5)
    checksum, start = 0, time.perf_counter()
    try:
        for step in range(STEPS):
            size = SIZES[step // (STEPS // len(SIZES) + 1)]  # the batch shrinks as requests end
            graphs[size].replay()
            logits = group.gather_last_dim(outs[size] @ head.t())  # rank 0: [size, 32000]
            ids = logits.argmax(-1) if group.rank == 0 else torch.empty(
                size, dtype=torch.int64, device=device)
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
