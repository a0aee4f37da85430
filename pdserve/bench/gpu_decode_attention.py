"""Decode attention alone on the GPU: attention + reduce (two launches) against the merged kernel.

    python -m pdserve.bench.gpu_decode_attention [--out DIR]
    python -m pdserve.bench.gpu_decode_attention --sweep [--batch 256] [--out DIR]

NOTE: as the engine runs it. 16 layers of Llama-3.2-1B's attention (32 q / 8 kv heads x 64, bf16,
16-token blocks, a separate cache per layer so no layer hits L2 from the one before) captured in
one CUDA graph and replayed; us per layer = replay time / 16. Split counts: as the decode graphs
size them (for max_model_len 4096) and as an eager step would (for the context itself). Each
case also checks the merged output against the two-kernel one.

`--sweep`: W1's decode batch instead (256 sequences of 128-640 tokens, uniform, one split as
`default_num_splits` gives there), the two-kernel path's launch settings swept (tile BLOCK_N,
warps, pipeline stages), each as us per layer and as the bytes of K and V it must read over
the time, against a 1 GiB device copy timed in the same run. Each setting's output is checked
against the default's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kernels.paged_decode_attention import default_num_splits, paged_decode_attention
from kernels.paged_decode_attention_merged import paged_decode_attention_merged
from pdserve.bench.gpu_decode_gemms import copy_rate

LAYERS, BLOCK, KV_HEADS, HEADS, DIM = 16, 16, 8, 32, 64
BATCHES, CONTEXTS, MAX_MODEL_LEN = (1, 32), (128, 256, 512, 1024, 2048, 4096), 4096


def graph_us(calls: Callable[[], object], replays: int = 100) -> float:
    """us per call of `calls()` (LAYERS launches) replayed from a CUDA graph."""
    calls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / LAYERS


def measure() -> list[dict]:
    sms = torch.cuda.get_device_properties().multi_processor_count
    blocks = max(BATCHES) * MAX_MODEL_LEN // BLOCK
    caches = [torch.randn(2, blocks, BLOCK, KV_HEADS, DIM, device="cuda").bfloat16()
              for _ in range(LAYERS)]
    rows = []
    for batch in BATCHES:
        q = torch.randn(batch, HEADS, DIM, device="cuda").bfloat16()
        outs = [torch.empty_like(q) for _ in range(LAYERS)]
        for ctx in CONTEXTS:
            per_seq = MAX_MODEL_LEN // BLOCK
            tables = torch.randperm(blocks, device="cuda")[: batch * per_seq]
            tables = tables.view(batch, per_seq).int()
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            for policy, max_len in (("graph", MAX_MODEL_LEN), ("eager", ctx)):
                splits = default_num_splits(batch, KV_HEADS, max_len, sms)
                row = dict(batch=batch, context=ctx, policy=policy, splits=splits)
                for name, kernel in (("two_kernels", paged_decode_attention),
                                     ("merged", paged_decode_attention_merged)):
                    launches = [partial(kernel, q, c[0], c[1], tables, lens, 0.125,
                                        num_splits=splits, out=o) for c, o in zip(caches, outs)]
                    row[f"{name}_us"] = graph_us(lambda launches=launches: [f() for f in launches])
                    row[f"{name}_out"] = outs[0].float().clone()
                two, one = row.pop("two_kernels_out"), row.pop("merged_out")
                row["max_abs_diff"] = (two - one).abs().max().item()
                row["speedup"] = row["two_kernels_us"] / row["merged_us"]
                rows.append(row)
                _print_row(row)
    return rows


def _print_row(row: dict) -> None:
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in row.items()), flush=True)


def sweep(batch: int, lo: int = 128, hi: int = 640) -> list[dict]:
    """The `--sweep` of the NOTE."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen, device="cuda", dtype=torch.int32)
    per_seq = -(-hi // BLOCK)
    blocks = batch * per_seq
    caches = [torch.randn(2, blocks, BLOCK, KV_HEADS, DIM, device="cuda").bfloat16()
              for _ in range(LAYERS)]
    tables = torch.randperm(blocks, device="cuda").view(batch, per_seq).int()
    q = torch.randn(batch, HEADS, DIM, device="cuda").bfloat16()
    outs = [torch.empty_like(q) for _ in range(LAYERS)]
    splits = default_num_splits(batch, KV_HEADS, hi, sms)
    kv_bytes = int(lens.sum()) * KV_HEADS * DIM * 2 * 2  # K and V, bf16, one layer
    copy = copy_rate(torch.device("cuda"))
    rows, want = [], None
    for block_n in (128, 64, 32):
        for warps in (4, 2, 8):
            for stages in (3, 1, 2, 4):
                launches = [partial(paged_decode_attention, q, c[0], c[1], tables, lens, 0.125,
                                    num_splits=splits, out=o, block_n=block_n,
                                    num_warps=warps, num_stages=stages)
                            for c, o in zip(caches, outs)]
                try:
                    us = graph_us(lambda launches=launches: [f() for f in launches])
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    rows.append(dict(block_n=block_n, warps=warps, stages=stages,
                                     error=f"{type(exc).__name__}: {exc}"[:200]))
                    continue
                got = outs[0].float().clone()
                want = got if want is None else want
                row = dict(block_n=block_n, warps=warps, stages=stages, splits=splits, us=us,
                           bytes_per_s=kv_bytes / (us / 1e6), of_copy=kv_bytes / (us / 1e6) / copy,
                           max_abs_diff=(got - want).abs().max().item())
                rows.append(row)
                _print_row(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for decode_attention.json")
    parser.add_argument("--sweep", action="store_true", help="W1's batch, launch settings swept")
    parser.add_argument("--batch", type=int, default=256, help="--sweep: sequences")
    args = parser.parse_args()
    rows = sweep(args.batch) if args.sweep else measure()
    if args.out:
        path = Path(args.out) / "decode_attention.json"
        path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                   indent=1))


if __name__ == "__main__":
    main()
