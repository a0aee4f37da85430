"""Offline data parallelism: N engine replicas (DP ranks), each sharded over M GPUs (tensor
parallel), each generating its contiguous share of the prompts. pdserve's take on vLLM's
examples/offline_inference/data_parallel.py.

    python examples/data_parallel.py --dp-size 2 --tp-size 1               # 2 GPUs
    python examples/data_parallel.py --dp-size 2 --tp-size 2 --model PATH  # 4 GPUs
    python examples/data_parallel.py --dp-size 2 --device cpu              # no GPU

Each DP rank is a process of its own, spawned so that it picks its GPUs before torch loads:
rank i sees GPUs i*M .. i*M+M-1 (of those the shell makes visible) as cuda:0 .. cuda:M-1. The
ranks share nothing (no collectives between them), so a rank whose share is empty, with more
ranks than prompts, loads no model and returns nothing; vLLM's example gives such a rank a dummy
prompt instead, because its ranks must step together (expert parallelism).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
JOIN_TIMEOUT_S = 300


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp-size", type=int, default=2, help="engine replicas (processes)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks per replica")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled one)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--device", default="auto", choices=["auto", "cpu"])
    return p.parse_args()


def share(num_prompts: int, dp_size: int, rank: int) -> range:
    """Rank `rank`'s prompt indices: contiguous, the first `num_prompts % dp_size` ranks one more.

        10 prompts, 4 ranks:  [0 1 2] [3 4 5] [6 7] [8 9]
    """
    floor, remainder = divmod(num_prompts, dp_size)
    start = rank * floor + min(rank, remainder)
    return range(start, start + floor + (rank < remainder))


def gpus_of(rank: int, tp_size: int) -> str:
    """DP rank `rank`'s CUDA_VISIBLE_DEVICES: its `tp_size` GPUs of those visible to the shell."""
    first = rank * tp_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(first + tp_size)]
    return ",".join(ids[first:first + tp_size])


def run_rank(rank: int, args: argparse.Namespace, results: mp.Queue) -> None:
    """One DP rank: generate its share and put `(rank, [(prompt index, text), ...])`."""
    if args.device == "auto":
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus_of(rank, args.tp_size)
    indices = share(args.num_prompts, args.dp_size, rank)
    if not indices:
        print(f"DP rank {rank}: no prompts", flush=True)
        results.put((rank, []))
        return
    from pdserve import LLM, SamplingParams  # torch loads here, after CUDA_VISIBLE_DEVICES

    llm = LLM(args.model, tensor_parallel_size=args.tp_size, device=args.device)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in indices]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in zip(indices, outputs):
        print(f"DP rank {rank}, prompt {i}: {out.prompt!r} -> {out.outputs[0].text!r}", flush=True)
    results.put((rank, [(i, out.outputs[0].text) for i, out in zip(indices, outputs)]))


def main() -> int:
    args = parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(rank, args, results))
             for rank in range(args.dp_size)]
    for p in procs:
        p.start()
    texts: dict[int, list[tuple[int, str]]] = {}
    # Read the queue while the ranks run: a rank exits only once what it put has been read.
    while len(texts) < len(procs) and (any(p.is_alive() for p in procs) or not results.empty()):
        try:
            rank, outputs = results.get(timeout=1)
            texts[rank] = outputs
        except queue.Empty:
            pass
    for rank, p in enumerate(procs):
        p.join(timeout=JOIN_TIMEOUT_S)
        if p.exitcode is None:
            print(f"DP rank {rank} did not exit in {JOIN_TIMEOUT_S} s: killing it", file=sys.stderr)
            p.kill()
            p.join()
    failed = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode != 0}
    done = sum(len(outputs) for outputs in texts.values())
    if failed or done != args.num_prompts:
        print(f"{done} of {args.num_prompts} outputs; DP ranks that failed (rank: exit code): "
              f"{failed}", file=sys.stderr)
        return 1
    print(f"{done} outputs from {args.dp_size} DP ranks x TP {args.tp_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
