"""Decode attention alone on the GPU: attention + reduce (two launches) against the merged kernel.

    python -m pdserve.bench.gpu_decode_attention [--out DIR]

NOTE: as the engine runs it. 16 layers of Llama-3.2-1B's attention (32 q / 8 kv heads x 64, bf16,
16-token blocks, a separate cache per layer so no layer hits L2 from the one before) captured in
one CUDA graph and replayed; us per layer = replay time / 16. Split counts: as the decode graphs
size them (for max_model_len 4096) and as an eager step would (for the context itself). Each
case also checks the merged output against the two-kernel one.
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
                print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for decode_attention.json")
    args = parser.parse_args()
    rows = measure()
    if args.out:
        path = Path(args.out) / "decode_attention.json"
        path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                   indent=1))


if __name__ == "__main__":
    main()
