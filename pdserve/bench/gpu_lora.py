"""Multi-LoRA serving cost: the same workload on the base model and under four adapters.

    PYTHONPATH=. python -m pdserve.bench.gpu_lora --out DIR [--small]

The random Llama-3.2-1B shape of `pdserve bench gpu` (gpu_model.py, bf16) and its throughput
workload (256 requests, prompts of 128-512 random tokens, 128 greedy output tokens each), and
four random rank-16 PEFT adapters over all seven projections, written in PEFT's file format.
Three engines run it one after the other, in the same process:

  base        `LLM(model)`: no LoRA at all
  lora_base   `LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)`, every request on the
              base model (what enabling LoRA costs the requests that use none)
  lora_mixed  the same engine, requests spread evenly over the four adapters (one batch mixes
              all four: the batched shrink/expand of kernels/lora.py; at decode sizes the
              shrink folded into the base GEMV, engine/lora/layers.py)
  lora_unfolded  batch-1 only: a LoRA engine with the shrink-and-expand kernels at every size
              (the path before the fold), for an A/B in one run

For each: the workload's wall time (after one untimed pass of it) and output tokens/s, and
batch-1 decode ms/token (median of fresh prompts, (time of 1 + N tokens - time of 1) / N),
under an adapter for the LoRA engine. On CUDA also the LoRA kernels at one token against the
base GEMVs (`kernels_one_token`).
The report gives lora / base time ratios; targets: mixed throughput time <= 1.3x the base's,
batch-1 overhead <= 15%. JSON goes to DIR/bench_gpu_lora.json. `--small` runs a tiny shape
(the CPU can run it: it checks the code, not the speed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_model import SMALL_MODEL, ModelSizes, RandomModel, free_device_memory, log
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.throughput import make_workload

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
NUM_ADAPTERS = 4
RANK = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of the JSON report")
    parser.add_argument("--small", action="store_true", help="a tiny shape (checks the code)")
    parser.add_argument("--seed", type=int, default=0)


def projection_shapes(sizes: ModelSizes) -> dict[str, tuple[int, int]]:
    """(out, in) features of each HF projection of the benchmark's model."""
    s = sizes.shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {"q_proj": (q, s.hidden), "k_proj": (kv, s.hidden), "v_proj": (kv, s.hidden),
            "o_proj": (s.hidden, q), "gate_proj": (s.intermediate, s.hidden),
            "up_proj": (s.intermediate, s.hidden), "down_proj": (s.hidden, s.intermediate)}


def write_adapter(folder: Path, sizes: ModelSizes, rank: int, seed: int) -> str:
    """A random PEFT adapter (A ~ N(0, 1/in), B ~ N(0, 0.01)) of every projection."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(sizes.shape.layers):
        for proj, (out_f, in_f) in projection_shapes(sizes).items():
            key = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen)
                                               / in_f**0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen)
                                               * 0.01).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": list(PROJECTIONS), "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def _greedy(max_tokens: int) -> Any:
    from pdserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_workload(llm: Any, prompts: list[list[int]], output_len: int,
                 loras: list[Any]) -> dict[str, float]:
    """All prompts in one `generate`, timed after one untimed pass of the same call (a fresh
    machine has no Triton cache: the shapes the run meets compile there): seconds, tokens/s."""
    params = _greedy(output_len)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                 lora_request=loras)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}


def batch1_ms_per_token(llm: Any, prompts: list[list[int]], n: int, lora: Any) -> float:
    """Median over prompt pairs of (time of 1 + n tokens - time of 1 token) / n."""
    def timed(prompt: list[int], max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], _greedy(max_tokens), use_tqdm=False,
                     lora_request=lora)
        return time.perf_counter() - start

    timed(prompts[-1], n + 1)  # warm-up
    pairs = (len(prompts) - 1) // 2
    short = [timed(prompts[2 * i], 1) for i in range(pairs)]
    longs = [timed(prompts[2 * i + 1], n + 1) for i in range(pairs)]
    return (statistics.median(longs) - statistics.median(short)) / n * 1e3


def unfolded_batch1(models: RandomModel, prompts: list[list[int]], n: int, lora: Any) -> float:
    """batch1_ms_per_token under `lora` with the shrink-and-expand kernels at every size (the
    path before engine/lora/layers.py folded the shrink into the base GEMV): an engine built,
    graphs captured and measured with FOLD_MAX_TOKENS at 0, then set back."""
    from engine.lora import layers

    saved, layers.FOLD_MAX_TOKENS = layers.FOLD_MAX_TOKENS, 0
    try:
        llm = models.llm()
        ms = batch1_ms_per_token(llm, prompts, n, lora)
        del llm
        models.close_llm()
    finally:
        layers.FOLD_MAX_TOKENS = saved
    return ms


FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def kernels_one_token(sizes: ModelSizes, device: torch.device) -> dict[str, dict[str, float]]:
    """Per fused projection at one token (slot 0 of 4, rank 16), us per call over every
    layer's weights in turn, from one CUDA graph (engine/cuda_timing.py): the base GEMV
    alone (`base`); plus today's LoRA launch (`unfolded`, kernels/lora.py); the folded GEMV
    (base rows and the 4 slots' A rows) plus its expand (`folded`, kernels/lora_fold.py).
    GEMV tiles as the decode plan chose them on the H100 (PDL launches)."""
    shapes = projection_shapes(sizes)
    report = {}
    for name, parts in FUSED.items():
        offsets = tuple(itertools.accumulate((shapes[p][0] for p in parts), initial=0))
        report[name] = _projection_us(offsets, shapes[parts[0]][1], 4 if name == "qkv" else 2,
                                      sizes.shape.layers, device)
        torch.cuda.empty_cache()
    return report


def _projection_us(offsets: tuple[int, ...], k: int, block_n: int, layers: int,
                   device: torch.device) -> dict[str, float]:
    from engine.cuda_timing import graph_us
    from kernels.gemv import GemvBlocks, gemv
    from kernels.lora import lora_apply
    from kernels.lora_fold import lora_fold_expand

    dt, n, a_rows = torch.bfloat16, offsets[-1], (len(offsets) - 1) * RANK
    blocks = GemvBlocks(block_n, 1024, 4, pdl=True)
    x = torch.randn(1, k, device=device, dtype=dt)
    slots = torch.zeros(1, dtype=torch.int32, device=device)
    weights = [(torch.randn(n + NUM_ADAPTERS * a_rows, k, device=device, dtype=dt) * 0.02,
                torch.randn(NUM_ADAPTERS, n, RANK, device=device, dtype=dt) * 0.01)
               for _ in range(layers)]

    def base(f: torch.Tensor, b: torch.Tensor) -> object:
        return gemv(x, f[:n], None, blocks)

    def unfolded(f: torch.Tensor, b: torch.Tensor) -> object:
        y = gemv(x, f[:n], None, blocks)
        lora_apply(x, f[n:].view(NUM_ADAPTERS, a_rows, k), b, slots, y, offsets)
        return y

    def folded(f: torch.Tensor, b: torch.Tensor) -> object:
        return lora_fold_expand(gemv(x, f, None, blocks), b, slots, offsets, pdl=True)

    return {fn.__name__: graph_us([lambda f=f, b=b, fn=fn: fn(f, b) for f, b in weights])
            for fn in (base, unfolded, folded)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve import LoRARequest

    sizes = SMALL_MODEL if args.small else ModelSizes()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    base_kwargs: dict[str, Any] = {"max_num_seqs": sizes.max_num_seqs,
                                   "kv_cache_memory": sizes.kv_cache_memory}
    if device.type == "cpu":
        base_kwargs.update(dtype="bfloat16", device="cpu")
    models = RandomModel(sizes, device, args.seed, None, base_kwargs)
    report: dict[str, Any] = {"config": config_of(args), "device": str(device),
                              "adapters": NUM_ADAPTERS, "rank": RANK, "systems": {}}
    try:
        adapters = [LoRARequest(f"adapter{i}", i + 1,
                                write_adapter(Path(models.folder) / f"adapter{i}", sizes, RANK,
                                              args.seed + i))
                    for i in range(NUM_ADAPTERS)]
        tok = models.llm().get_tokenizer()
        workload = make_workload(tok, sizes.num_requests, sizes.input_len_range,
                                 (sizes.output_len, sizes.output_len), args.seed)
        latency_prompts = make_workload(tok, 2 * sizes.latency_repeats + 1,
                                        (sizes.latency_prompt_len,) * 2, (1, 1),
                                        args.seed + 2).prompts
        n = sizes.latency_decode_tokens
        report["workload"] = {"requests": len(workload.prompts),
                              "input_tokens": workload.input_tokens,
                              "output_tokens_each": sizes.output_len}
        none = [None] * len(workload.prompts)
        mixed = [adapters[i % NUM_ADAPTERS] for i in range(len(workload.prompts))]
        log("base model")
        llm = models.llm()
        report["systems"]["base"] = {
            **run_workload(llm, workload.prompts, sizes.output_len, none),
            "batch1_ms_per_token": batch1_ms_per_token(llm, latency_prompts, n, None)}
        del llm  # the only other reference: close_llm frees its weights and KV cache
        models.close_llm()
        log("LoRA engine")
        models.llm_kwargs = {**base_kwargs, "enable_lora": True, "max_loras": NUM_ADAPTERS,
                             "max_lora_rank": RANK}
        llm = models.llm()
        report["systems"]["lora_base"] = {
            **run_workload(llm, workload.prompts, sizes.output_len, none),
            "batch1_ms_per_token": batch1_ms_per_token(llm, latency_prompts, n, None)}
        report["systems"]["lora_mixed"] = {
            **run_workload(llm, workload.prompts, sizes.output_len, mixed),
            "batch1_ms_per_token": batch1_ms_per_token(llm, latency_prompts, n, adapters[0])}
        graphs = llm.llm_engine.runner.graphs
        report["cuda_graph_replays"] = None if graphs is None else graphs.replays
        del llm, graphs
        models.close_llm()
        log("LoRA engine without the folded shrink")
        report["systems"]["lora_unfolded"] = {
            "batch1_ms_per_token": unfolded_batch1(models, latency_prompts, n, adapters[0])}
        base = report["systems"]["base"]
        report["ratios"] = {
            f"{name}_time_over_base": s["seconds"] / base["seconds"]
            for name, s in report["systems"].items() if name != "base" and "seconds" in s
        } | {
            f"{name}_batch1_over_base": s["batch1_ms_per_token"] / base["batch1_ms_per_token"]
            for name, s in report["systems"].items() if name != "base"
        }
        if device.type == "cuda":
            log("the kernels at one token")
            report["kernels_one_token_us"] = kernels_one_token(sizes, device)
        print(json.dumps({k: report[k] for k in ("systems", "ratios")}, indent=2))
    finally:
        models.remove()
        free_device_memory()
    write_report(report, str(out / "bench_gpu_lora.json"))
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_lora", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
