"""Expert parallelism's communication: all-to-all against replicated tokens + all-reduce.

    python -m pdserve.bench.ep_comm [--world 2] [--tokens 1,8,64,256,1024,4096] [--device cuda]

NOTE: the two ways tokens can reach whole experts on N ranks (engine/models/moe.py, EP size =
TP size), timed alone, with a stand-in for the experts' work (y = x * (1 + e) for expert e) so
that both produce the same layer output and are checked against each other every size:

  replicated   what pdserve does: every rank holds all T tokens (tensor parallelism keeps
               activations replicated), runs its own experts on the tokens routed to them,
               weighted, into a [T, H] partial sum; one all-reduce gives every rank the layer's
               output. Traffic: the all-reduce of T x H.
  all_to_all   DeepSeek/DeepEP-style: rank r routes only its T/N slice of the tokens; the
               (token, expert) pairs are sorted by the expert's rank and sent there (the counts
               first, an all-to-all of N ints that the host must read: the split sizes), the
               experts run, the rows come back (a second all-to-all), each token's top-k rows
               are summed with their weights, and an all-gather of the [T/N, H] slices gives
               every rank all T outputs again (what the next attention layer needs under TP).
               Traffic: 2 x T x k x H x (N-1)/N^2 and the all-gather.

Per size and method: the median time of `--iters` timed calls after `--warmup`, in microseconds,
and their ratio. bf16 on CUDA (NCCL), fp32 on the CPU (gloo: checks the code, times nothing of
interest). One process per rank, spawned here; rank 0 prints and writes the report.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed.sharding import even_split
from pdserve.bench.report import bench_main, config_of, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs on CUDA)")
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-json", default="bench_results/ep_comm.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"ep_comm: {args.world} ranks need {args.world} GPUs, "
              f"{torch.cuda.device_count()} here; skipped")
        return {}
    from pdserve.ports import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args, port, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"ep_comm ranks exited with {[p.exitcode for p in procs]}")
    for row in rows:
        print(f"T {row['tokens']:5d}: replicated {row['replicated_us']:8.1f} us, all_to_all "
              f"{row['all_to_all_us']:8.1f} us, all_to_all / replicated "
              f"{row['all_to_all_us'] / row['replicated_us']:.2f}")
    report = {"config": config_of(args), "rows": rows}
    write_report(report, args.output_json)
    return report


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        routing = Routing.random(tokens, args.hidden, args.experts, args.top_k, device, dtype)
        mine = _experts_of(rank, args.world, args.experts)
        a = replicated(routing, mine)
        b = all_to_all(routing, rank, args.world, args.experts)
        tol = 1e-2 if cuda else 1e-5
        if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
            raise AssertionError(f"T={tokens}: all_to_all differs from replicated by "
                                 f"{(a.float() - b.float()).abs().max().item():.3g}")
        rows.append({
            "tokens": tokens,
            "replicated_us": _median_us(partial(replicated, routing, mine), args, cuda),
            "all_to_all_us": _median_us(
                partial(all_to_all, routing, rank, args.world, args.experts), args, cuda),
        })
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


class Routing:
    """One layer's tokens and their router's choice, the same on every rank (seeded)."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.x, self.ids, self.weights = x, ids, weights  # [T, H], [T, K] long, [T, K]

    @classmethod
    def random(cls, tokens: int, hidden: int, experts: int, top_k: int, device: torch.device,
               dtype: torch.dtype) -> Routing:
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, generator=gen).softmax(-1)
        return cls(x, ids.to(device), weights.to(device, dtype))


def expert_work(rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """The experts' stand-in: row i scaled by 1 + its expert's id."""
    return rows * (1 + expert).to(rows.dtype).unsqueeze(1)


def _experts_of(rank: int, world: int, experts: int) -> torch.Tensor:
    """Whole experts per rank as engine/models/moe.py deals them."""
    return torch.tensor(list(even_split(experts, world, rank)), dtype=torch.long)


def replicated(r: Routing, mine: torch.Tensor) -> torch.Tensor:
    """Every rank: its experts over all tokens routed to them, weighted, all-reduced."""
    local = torch.isin(r.ids, mine.to(r.ids.device))  # [T, K]
    tok, slot = local.nonzero(as_tuple=True)
    out = torch.zeros_like(r.x)
    rows = expert_work(r.x[tok], r.ids[tok, slot]) * r.weights[tok, slot].unsqueeze(1)
    out.index_add_(0, tok, rows)
    dist.all_reduce(out)
    return out


def all_to_all(r: Routing, rank: int, world: int, experts: int) -> torch.Tensor:
    """Rank `rank` routes its slice of tokens to the experts' ranks and back, then all ranks
    all-gather the slices (T padded to a multiple of `world`)."""
    tokens, hidden = r.x.shape
    share = -(-tokens // world)
    lo, hi = rank * share, min((rank + 1) * share, tokens)
    x, ids, weights = r.x[lo:hi], r.ids[lo:hi], r.weights[lo:hi]  # my slice
    owner = _owner_table(world, experts, ids.device)[ids.flatten()]  # [t*K]: each pair's rank
    order = owner.argsort(stable=True)
    send_counts = torch.bincount(owner, minlength=world)  # [N]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()  # the host must know
    pair_tok = order // ids.shape[1]
    sent_rows = x[pair_tok]  # [t*K, H] sorted by owner
    sent_expert = ids.flatten()[order]
    got_rows = x.new_empty(sum(recv_split), hidden)
    got_expert = sent_expert.new_empty(sum(recv_split))
    dist.all_to_all_single(got_rows, sent_rows, recv_split, send_split)
    dist.all_to_all_single(got_expert, sent_expert, recv_split, send_split)
    done = expert_work(got_rows, got_expert)
    back = x.new_empty(sent_rows.shape)
    dist.all_to_all_single(back, done, send_split, recv_split)
    mine_out = torch.zeros(share, hidden, dtype=x.dtype, device=x.device)
    weighted = back * weights.flatten()[order].unsqueeze(1)
    mine_out.index_add_(0, pair_tok, weighted)
    gathered = x.new_empty(share * world, hidden)
    _all_gather(gathered, mine_out)
    return gathered[:tokens]


# torch 2.13 renamed all_gather_into_tensor (still there, deprecated); the GPU image has 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _owner_table(world: int, experts: int, device: torch.device) -> torch.Tensor:
    owner = torch.empty(experts, dtype=torch.long)
    for rank in range(world):
        owner[_experts_of(rank, world, experts)] = rank
    return owner.to(device)


def _median_us(fn: Callable[[], torch.Tensor], args: argparse.Namespace, cuda: bool) -> float:
    times = []
    for i in range(args.warmup + args.iters):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    return bench_main("ep_comm", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
