"""The KV block-copy kernel (kernels/kv_block_copy.py) against the device's own ceilings, on
one request's KV of the 1B shape (16 layers, 8 KV heads of 64, bf16, blocks of 16 tokens: 16 KiB
a block per layer and K or V), shuffled block ids on both sides:

    python -m pdserve.bench.gpu_kv_copy [--kv-tokens 1024,4096,16384] [--repeats 50] [--out DIR]

  copy      `copy_` of the same bytes, contiguous: the ceiling the data planes are held to
  scatter   torch's `index_copy_` of the gathered blocks into the shuffled ones (one pass)
  kernel    `copy_kv_blocks` (gather and scatter in one pass, what cuda_ipc runs), for each
            `--blocks` x `--warps` setting

Each is timed with CUDA events around `--repeats` back-to-back calls after a warm-up; the report
gives GiB/s of KV moved and each over the contiguous copy. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kernels.kv_block_copy import copy_kv_blocks
from pdserve.bench.transfer import parse_sizes

GIB = 1 << 30
LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 64, 16


def timed(fn: Any, repeats: int) -> float:
    """Seconds per call of `fn`, CUDA events around `repeats` calls after one warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure(tokens: int, blocks: list[int], warps: list[int], repeats: int) -> dict[str, Any]:
    n = tokens // BLOCK_SIZE
    total = 2 * n + 16  # room for both id lists' blocks in one pool each
    gen = torch.Generator().manual_seed(tokens)
    shape = (LAYERS, 2, total, BLOCK_SIZE, HEADS, HEAD_DIM)
    src = torch.randn(shape, generator=gen).to(torch.bfloat16).cuda()
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
    for b in blocks:
        for w in warps:
            rows[f"kernel block {b} warps {w}"] = timed(
                lambda b=b, w=w: copy_kv_blocks(src, dst, 0, LAYERS, src_ids, dst_ids,
                                                block=b, num_warps=w), repeats)
    expected = src[:, :, src_ids]
    copy_kv_blocks(src, dst, 0, LAYERS, src_ids, dst_ids)
    if not torch.equal(dst[:, :, dst_ids], expected):
        raise AssertionError(f"{tokens} tokens: the kernel's blocks differ from the source's")
    return {"num_tokens": tokens, "kv_bytes": nbytes,
            "cases": [{"name": k, "seconds": s, "gib_per_s": nbytes / s / GIB,
                       "over_copy": rows["copy"] / s} for k, s in rows.items()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-tokens", type=parse_sizes, default=[1024, 4096, 16384])
    parser.add_argument("--blocks", type=parse_sizes, default=[2048, 4096, 8192])
    parser.add_argument("--warps", type=parse_sizes, default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None, help="folder for gpu_kv_copy.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kv_copy: needs a CUDA GPU", file=sys.stderr)
        return 2
    report = {"gpu": torch.cuda.get_device_name(),
              "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM,
                        "block_size": BLOCK_SIZE, "dtype": "bfloat16"},
              "runs": [measure(t, args.blocks, args.warps, args.repeats)
                       for t in args.kv_tokens]}
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
