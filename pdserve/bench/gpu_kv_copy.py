"""The KV block-copy kernel (kernels/kv_block_copy.py) against the device's own ceilings, on
one request's KV of the 1B shape (16 layers, 8 KV heads of 64, bf16, blocks of 16 tokens: 16 KiB
a block per layer and K or V), shuffled block ids on both sides:

    python -m pdserve.bench.gpu_kv_copy [--kv-tokens 1024,4096,16384] [--repeats 50] [--out DIR]

  copy      `copy_` of the same bytes, contiguous: the ceiling the data planes are held to
  scatter   torch's `index_copy_` of the gathered blocks into the shuffled ones (one pass)
  kernel    `copy_kv_blocks` (gather and scatter in one pass, what cuda_ipc runs), for each
            `--blocks` x `--warps` setting

Across two GPUs of one host (the source pool on cuda:0, the destination pool on cuda:1, each GPU
given peer access to the other), what cuda_ipc's one-pass write between GPUs runs:

    python -m pdserve.bench.gpu_kv_copy --peer --out DIR     # gpu_kv_copy_peer.json

  peer_copy  `copy_` of the same bytes, contiguous, cuda:0 to cuda:1: the ceiling
  push       `copy_kv_blocks(peer=True)` on cuda:0 (its ids there) storing into cuda:1's pool
  pull       `copy_kv_blocks(peer=True)` on cuda:1 (its ids there) loading from cuda:0's pool
  runs       the copy engine: one cudaMemcpy2DAsync per run of blocks consecutive on both sides
             (pdserve/transport/block_runs.py), the shuffled ids (a call a block) and sequential
             ones (one call), queued on cuda:0

each push and pull for every `--blocks` x `--warps` setting (by default 2048 and 8192 elements
a step, 4/8/16 warps), each checked once against the source's blocks (compared on cuda:0)
before it is timed. (Its first run, 2026-11-28, also swept several blocks a program; no setting
beat the kernel's default, and that option is gone.)

Each is timed with CUDA events, recorded on the GPU that runs it, around `--repeats` (50; 20 with
--peer) back-to-back calls after a warm-up, both GPUs synchronised around; the report gives GiB/s
of KV moved and each over the contiguous copy. GPU only (--peer: two with peer access).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kernels.kv_block_copy import copy_kv_blocks
from pdserve.bench.transfer import parse_sizes
from pdserve.transport.block_runs import copy_block_runs, runs

GIB = 1 << 30
LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 64, 16
DTYPE = torch.bfloat16
SHAPE = {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
         "dtype": "bfloat16"}
# per mode (--peer or not): calls timed, elements a step
DEFAULTS = {False: (50, [2048, 4096, 8192]), True: (20, [2048, 8192])}


def timed(fn: Any, repeats: int, device: torch.device | None = None,
          sync: tuple[torch.device, ...] = ()) -> float:
    """Seconds per call of `fn`: CUDA events on `device`'s current stream (the current GPU's by
    default) around `repeats` calls after one warm-up, that GPU and those of `sync`
    synchronised before the first event and after the last."""
    with torch.cuda.device(device):
        fn()
        for d in (None, *sync):
            torch.cuda.synchronize(d)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        for d in (None, *sync):
            torch.cuda.synchronize(d)
        return start.elapsed_time(end) / 1e3 / repeats


def setting_name(block: int, warps: int) -> str:
    return f"block {block} warps {warps}"


def measure(tokens: int, settings: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    n = tokens // BLOCK_SIZE
    total = 2 * n + 16  # room for both id lists' blocks in one pool each
    gen = torch.Generator().manual_seed(tokens)
    shape = (LAYERS, 2, total, BLOCK_SIZE, HEADS, HEAD_DIM)
    src = torch.randn(shape, generator=gen).to(DTYPE).cuda()
    dst = torch.zeros_like(src)
    src_ids = torch.randperm(total, generator=gen)[:n].cuda()
    dst_ids = torch.randperm(total, generator=gen)[:n].cuda()
    nbytes = LAYERS * 2 * n * src[0, 0, 0].numel() * src.element_size()
    flat = src[:, :, src_ids].contiguous()
    out = torch.empty_like(flat)
    rows: dict[str, float] = {
        "copy": timed(lambda: out.copy_(flat), repeats),
        "scatter": timed(lambda: dst.index_copy_(2, dst_ids, flat), repeats),
    }
    for b, w in settings:
        rows[f"kernel {setting_name(b, w)}"] = timed(
            functools.partial(copy_kv_blocks, src, dst, 0, LAYERS, src_ids, dst_ids, block=b,
                              num_warps=w), repeats)
    expected = src[:, :, src_ids]
    copy_kv_blocks(src, dst, 0, LAYERS, src_ids, dst_ids)
    if not torch.equal(dst[:, :, dst_ids], expected):
        raise AssertionError(f"{tokens} tokens: the kernel's blocks differ from the source's")
    return {"num_tokens": tokens, "kv_bytes": nbytes,
            "cases": [{"name": k, "seconds": s, "gib_per_s": nbytes / s / GIB,
                       "over_copy": rows["copy"] / s} for k, s in rows.items()]}


def peer_unavailable() -> str | None:
    """Why the peer mode cannot run on this machine, or None."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return f"needs 2 CUDA GPUs with peer access; this machine has {count} GPU(s)"
    if not (torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)):
        return "needs 2 CUDA GPUs with peer access; cuda:0 and cuda:1 have none to each other"
    return None


def enable_peer_access(a: torch.device, b: torch.device) -> None:
    """From now on each GPU's kernels may load and store the other's memory: torch enables a
    copy's source GPU's access to its destination at their first copy."""
    torch.zeros(1, device=a).to(b).to(a)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


def peer_case(direction: str, setting: tuple[int, int], pools: tuple[torch.Tensor, ...],
              ids: torch.Tensor, expected: torch.Tensor, repeats: int) -> dict[str, Any]:
    """One push or pull setting: dst cleared, one copy checked against `expected` (the source's
    blocks, on src's GPU), then timed on the ids' GPU, the one that runs the kernel. `pools`:
    src, dst and dst's block ids on dst's GPU (to read the copy back)."""
    src, dst, dst_ids = pools
    b, w = setting
    run = functools.partial(copy_kv_blocks, src, dst, 0, LAYERS, ids[0], ids[1], block=b,
                            num_warps=w, peer=True)
    gpus = (src.device, dst.device)
    dst.zero_()
    torch.cuda.synchronize(dst.device)
    run()
    torch.cuda.synchronize(ids.device)
    equal = torch.equal(dst[:, :, dst_ids].to(src.device), expected)
    seconds = timed(run, repeats, ids.device, gpus)
    return {"name": f"{direction} {setting_name(b, w)}", "direction": direction, "block": b,
            "warps": w, "seconds": seconds, "equal": equal}


def copy_engine_case(name: str, src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor,
                     repeats: int) -> dict[str, Any]:
    """The copy engine instead of the kernel: one cudaMemcpy2DAsync per run of blocks
    consecutive on both sides (pdserve/transport/block_runs.py), queued on src's GPU; `ids`
    [2, n] on the CPU (shuffled: n runs of one block; sequential: one run)."""
    block_runs = runs(ids[0].numpy(), ids[1].numpy())
    run = functools.partial(copy_block_runs, src, dst, 0, LAYERS, block_runs)
    dst.zero_()
    torch.cuda.synchronize(dst.device)
    run()
    torch.cuda.synchronize(src.device)
    equal = torch.equal(dst[:, :, ids[1].to(dst.device)].to(src.device),
                        src[:, :, ids[0].to(src.device)])
    seconds = timed(run, repeats, src.device, (src.device, dst.device))
    return {"name": f"push {name}", "direction": "copy engine", "calls": len(block_runs),
            "seconds": seconds, "equal": equal}


def measure_peer(tokens: int, settings: list[tuple[int, int]], repeats: int,
                 here: torch.device, there: torch.device) -> dict[str, Any]:
    """peer_copy, then every setting's push (kernel on `here`) and pull (kernel on `there`),
    src's pool on `here`, dst's on `there`."""
    n = tokens // BLOCK_SIZE
    total = 2 * n + 16  # room for both id lists' blocks in one pool each
    gen = torch.Generator().manual_seed(tokens)
    shape = (LAYERS, 2, total, BLOCK_SIZE, HEADS, HEAD_DIM)
    on_here = torch.Generator(device=here).manual_seed(tokens)
    src = torch.randn(shape, generator=on_here, device=here, dtype=DTYPE)
    dst = torch.zeros(shape, device=there, dtype=DTYPE)
    ids = torch.stack([torch.randperm(total, generator=gen)[:n] for _ in range(2)])  # src, dst
    on = {"push": ids.to(here), "pull": ids.to(there)}  # [2, n]: the kernel runs on the ids' GPU
    expected = src[:, :, on["push"][0]]  # [L, 2, n, block_size, Hkv, D], contiguous
    out = torch.empty_like(expected, device=there)
    ceiling = timed(lambda: out.copy_(expected), repeats, here, (there,))
    nbytes = expected.numel() * expected.element_size()
    cases = [{"name": "peer_copy", "seconds": ceiling, "equal": torch.equal(out.to(here),
                                                                             expected)}]
    pools = (src, dst, on["pull"][1])
    cases += [peer_case(d, s, pools, on[d], expected, repeats) for d in on for s in settings]
    sequential = torch.stack([torch.arange(n), torch.arange(n) + n + 8])  # one run each side
    cases += [copy_engine_case(name, src, dst, block_ids, repeats)
              for name, block_ids in (("runs shuffled", ids), ("runs sequential", sequential))]
    for case in cases:
        case |= {"gib_per_s": nbytes / case["seconds"] / GIB,
                 "over_peer_copy": ceiling / case["seconds"]}
    return {"num_tokens": tokens, "kv_bytes": nbytes, "cases": cases}


def print_peer(run: dict[str, Any]) -> None:
    """One line a setting, push and pull side by side; '!' marks blocks that differed."""
    copy, *cases = run["cases"]
    print(f"{run['num_tokens']} tokens, {run['kv_bytes'] / 2**20:.0f} MiB: peer_copy "
          f"{copy['gib_per_s']:.1f} GiB/s{'' if copy['equal'] else ' !'}")
    print(f"  {'block':>5} {'warps':>5} {'push GiB/s':>11} {'x copy':>7} "
          f"{'pull GiB/s':>11} {'x copy':>7}")
    by_setting: dict[tuple[int, int], dict[str, str]] = {}
    for c in cases:
        if c["direction"] == "copy engine":
            continue
        mark = " " if c["equal"] else "!"
        by_setting.setdefault((c["block"], c["warps"]), {})[c["direction"]] = (
            f"{c['gib_per_s']:>11.1f} {c['over_peer_copy']:>6.3f}{mark}")
    for (b, w), cells in by_setting.items():
        print(f"  {b:>5} {w:>5} {cells.get('push', ''):>19} {cells.get('pull', '')}")
    for c in cases:
        if c["direction"] == "copy engine":
            print(f"  copy engine, {c['name'][5:]} ({c['calls']} calls): {c['gib_per_s']:.1f} "
                  f"GiB/s, {c['over_peer_copy']:.3f}x peer_copy{'' if c['equal'] else ' !'}")
    for direction in ("push", "pull"):
        best = max((c for c in cases if c["direction"] == direction and c["equal"]),
                   key=lambda c: c["gib_per_s"], default=None)
        if best:
            print(f"  best {best['name']}: {best['over_peer_copy']:.3f}x peer_copy")
    if not all(c["equal"] for c in run["cases"]):
        print("  ! blocks differ from the source's", flush=True)


def main_peer(args: argparse.Namespace, settings: list[tuple[int, int]]) -> int:
    reason = peer_unavailable()
    if reason:
        print(f"gpu_kv_copy --peer: {reason}", file=sys.stderr)
        return 2
    here, there = torch.device("cuda", 0), torch.device("cuda", 1)
    enable_peer_access(here, there)
    print(f"{torch.cuda.get_device_name(here)} cuda:0 -> {torch.cuda.get_device_name(there)} "
          f"cuda:1; {len(settings)} settings each way; {args.repeats} calls each", flush=True)
    runs = []
    for tokens in args.kv_tokens:
        runs.append(measure_peer(tokens, settings, args.repeats, here, there))
        print_peer(runs[-1])
        for device in (here, there):
            with torch.cuda.device(device):
                torch.cuda.empty_cache()
    report = {"gpus": [torch.cuda.get_device_name(d) for d in (here, there)],
              "src": "cuda:0", "dst": "cuda:1", "push_runs_on": "cuda:0",
              "pull_runs_on": "cuda:1", "shape": SHAPE, "repeats": args.repeats,
              "runs": runs}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_kv_copy_peer.json").write_text(json.dumps(report, indent=1))
    return 0 if all(c["equal"] for run in runs for c in run["cases"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer", action="store_true",
                        help="cuda:0's pool into cuda:1's (push and pull), against a peer copy_")
    parser.add_argument("--kv-tokens", type=parse_sizes, default=[1024, 4096, 16384])
    parser.add_argument("--blocks", type=parse_sizes, default=None,
                        help="elements a step (default 2048,4096,8192; --peer 2048,8192)")
    parser.add_argument("--warps", type=parse_sizes, default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=None, help="default 50; --peer 20")
    parser.add_argument("--out", default=None,
                        help="folder for gpu_kv_copy.json (--peer: gpu_kv_copy_peer.json)")
    args = parser.parse_args(argv)
    repeats, blocks = DEFAULTS[args.peer]
    args.repeats, args.blocks = args.repeats or repeats, args.blocks or blocks
    settings = [(b, w) for b in args.blocks for w in args.warps]
    if args.peer:
        return main_peer(args, settings)
    if not torch.cuda.is_available():
        print("gpu_kv_copy: needs a CUDA GPU", file=sys.stderr)
        return 2
    report = {"gpu": torch.cuda.get_device_name(), "shape": SHAPE,
              "runs": [measure(t, settings, args.repeats) for t in args.kv_tokens]}
    for run in report["runs"]:
        print(f"{run['num_tokens']} tokens, {run['kv_bytes'] / 2**20:.0f} MiB")
        for c in run["cases"]:
            print(f"  {c['name']:<28}{c['gib_per_s']:>9.1f} GiB/s {c['over_copy']:>6.3f}x copy")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_kv_copy.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
