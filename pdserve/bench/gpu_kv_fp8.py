"""Paged decode attention over a bf16 and an fp8 KV cache (`kv_cache_dtype="fp8"`), GPU time.

    PYTHONPATH=. python -m pdserve.bench.gpu_kv_fp8 --out DIR [--small]

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head dim 128, blocks of 16 tokens),
bf16 queries, every sequence of one length, shuffled block tables; the split count the engine
picks (default_num_splits) and tiles of 64, 128 and 256 tokens. Time per call from
triton.testing.do_bench (median); "GB/s" is the cache's bytes read per second. JSON goes to
DIR/bench_gpu_kv_fp8.json. `--small` runs tiny shapes (the interpreter on a CPU: checks the code).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from kernels.kv_cache_fp8 import KV_FP8
from kernels.paged_decode_attention import default_num_splits, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SHAPES = ((32, 4096), (64, 2048), (8, 16384), (1, 4096))  # (batch, tokens per sequence)


def time_ms(call: Callable[[], None], device: torch.device) -> float:
    """Median GPU time of a call (do_bench); on the CPU the wall time of one call after one."""
    if device.type == "cuda":
        return triton.testing.do_bench(call, warmup=25, rep=100)
    call()
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def measure(batch: int, length: int, device: torch.device, num_sms: int) -> list[dict]:
    """One row per (cache dtype, tile) at this batch x length."""
    gen = torch.Generator(device=device).manual_seed(0)
    num_blocks = batch * length // BLOCK
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=device).bfloat16()
    bf16 = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen,
                       device=device).bfloat16()
    caches = {"bfloat16": bf16, "float8_e4m3fn": bf16.to(KV_FP8)}
    tables = torch.randperm(num_blocks, generator=gen, device=device).int().view(batch, -1)
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    splits = default_num_splits(batch, KV_HEADS, length, num_sms)
    rows = []
    for name, cache in caches.items():
        for block_n in (64, 128, 256):
            def call(cache=cache, block_n=block_n) -> None:
                paged_decode_attention(q, cache[0], cache[1], tables, lens, HEAD_DIM**-0.5,
                                       num_splits=splits, block_n=block_n)

            ms = time_ms(call, device)
            rows.append({"batch": batch, "tokens": length, "kv_dtype": name, "splits": splits,
                         "block_n": block_n, "us": round(ms * 1e3, 1),
                         "gb_per_s": round(cache.nbytes / ms / 1e6)})
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for bench_gpu_kv_fp8.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 1
    shapes = ((2, 64),) if args.small else SHAPES
    rows = [row for b, n in shapes for row in measure(b, n, device, num_sms)]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "bench_gpu_kv_fp8.json"
    path.write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
