"""Where a cuda_ipc write's time goes, on one GPU, without gRPC around it:

    python pdserve/bench/gpu_kv_write_probe.py

A parent process allocates a KV pool (the 1B shape: 16 layers, 8 KV heads of 64, bf16, blocks
of 16 tokens) and hands it to a child, which maps it by CUDA IPC as a prefill worker maps a
decode worker's pool. For 1k / 4k / 16k tokens of shuffled blocks the child times (CUDA events,
30 calls) the block-copy kernel into a local pool and into the mapped one, and (wall clock,
median of 30) `CudaIpcPlane.write` into the mapped pool: the block ids to the GPU, the launch,
the synchronisation. The difference between the write and the kernel is the host's share.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from kernels.kv_block_copy import copy_kv_blocks
from pdserve.bench.gpu_kv_copy import BLOCK_SIZE, HEAD_DIM, HEADS, LAYERS, timed
from pdserve.bench.report import median_wall_ms
from pdserve.transport.base import CUDA_IPC, Peer
from pdserve.transport.cuda_ipc import CudaIpcPlane

TOKENS = (1024, 4096, 16384)


def probe(mapped: torch.Tensor, tokens: int) -> str:
    n, total = tokens // BLOCK_SIZE, mapped.shape[2]
    src = torch.randn(mapped.shape, device="cuda").to(torch.bfloat16)
    local = torch.zeros_like(src)
    gen = torch.Generator().manual_seed(tokens)
    src_ids = torch.randperm(total, generator=gen)[:n].cuda()
    dst_ids = torch.randperm(total, generator=gen)[:n].cuda()
    gib = LAYERS * 2 * n * src[0, 0, 0].numel() * src.element_size() / 2**30
    local_ms = 1e3 * timed(lambda: copy_kv_blocks(src, local, 0, LAYERS, src_ids, dst_ids), 30)
    mapped_ms = 1e3 * timed(lambda: copy_kv_blocks(src, mapped, 0, LAYERS, src_ids, dst_ids,
                                                peer=True), 30)
    plane, peer = CudaIpcPlane(src), Peer(None, CUDA_IPC, mapped, {"direct": True})
    s, d = src_ids.tolist(), dst_ids.tolist()
    write_ms = median_wall_ms(lambda: plane.write(peer, (0, LAYERS), s, d), 30)
    return (f"{tokens} tokens, {gib * 1024:.0f} MiB: kernel into a local pool {local_ms:.3f} ms "
            f"({gib / local_ms * 1e3:.0f} GiB/s), into the mapped pool {mapped_ms:.3f} ms "
            f"({gib / mapped_ms * 1e3:.0f} GiB/s); CudaIpcPlane.write {write_ms:.3f} ms "
            f"({gib / write_ms * 1e3:.0f} GiB/s), host share {write_ms - mapped_ms:.3f} ms")


def child(queue, done) -> None:
    mapped = queue.get()  # the parent's pool, mapped here by CUDA IPC
    for tokens in TOKENS:
        print(probe(mapped, tokens), flush=True)
        torch.cuda.empty_cache()
    done.set()


def main() -> None:
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    pool = torch.zeros(LAYERS, 2, 2 * max(TOKENS) // BLOCK_SIZE + 16, BLOCK_SIZE, HEADS,
                       HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    proc = ctx.Process(target=child, args=(queue, done))
    proc.start()
    queue.put(pool)
    done.wait(300)
    proc.join(30)


if __name__ == "__main__":
    main()
