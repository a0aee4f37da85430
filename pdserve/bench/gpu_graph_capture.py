"""What the decode graphs cost at start-up, with the argmax graphs and without.

    PYTHONPATH=. python -m pdserve.bench.gpu_graph_capture

The 1B-shaped random model (gpu_model.py) in bf16, `max_num_seqs` 256: `LLM()` three times in
one process with `DecodeGraphs.argmax_max_batch` 16, 0, 16 (the first also compiles the
kernels), printing each engine's capture line (graphs, seconds, the graph pool's MiB) and the
whole `LLM()`'s seconds.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time

import torch

from engine.cuda_graphs import DecodeGraphs
from pdserve import LLM
from pdserve.bench.gpu_model import ModelShape, save_random_model


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("engine.cuda_graphs").setLevel(logging.INFO)
    folder = tempfile.mkdtemp(prefix="pdserve-capture-")
    save_random_model(ModelShape(), folder, seed=0, device=torch.device("cuda"))
    for most in (16, 0, 16):
        DecodeGraphs.argmax_max_batch = most
        start = time.perf_counter()
        llm = LLM(folder, dtype="bfloat16", max_num_seqs=256, kv_cache_memory=4 << 30)
        print(f"argmax_max_batch={most}: LLM() {time.perf_counter() - start:.1f} s")
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
