"""A mixture-of-experts model end to end: pdserve against HF `generate_batch`, same run.

    PYTHONPATH=. python -m pdserve.bench.gpu_moe_e2e --out DIR [--hf-requests 64] [--small]

A random Mixtral-shaped model in bf16 that fits one H100 (8 experts, top 2, hidden 2048,
intermediate 7168, 16 layers, 32/8 attention heads of 64: about 11 GiB of experts) and the
`pdserve bench gpu` throughput workload (W1: 256 requests, prompts of 128-512 seeded random
tokens, 128 greedy output tokens each, eos ignored). pdserve runs every request in one
`LLM.generate` (the fused MoE kernel, CUDA graphs for decode); transformers' `generate_batch`
(its continuous batching, its loop over experts) runs the first `--hf-requests` of them. Each is
reported as output tokens/s of what it ran, and pdserve / HF as the ratio (the issue's target:
>= 10x). JSON goes to DIR/bench_gpu_moe_e2e.json. `--small` runs a tiny model on the CPU (it
checks the code, not the speed).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_generation import bench_hf_generate_batch, subset
from pdserve.bench.gpu_model import free_device_memory, log, save_stand_in_tokenizer
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.throughput import bench_pdserve, make_workload, summarize

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=7168, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, num_local_experts=8,
             num_experts_per_tok=2)
SMALL_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_local_experts=4, num_experts_per_tok=2)
WORKLOAD = dict(num_requests=256, input_range=(128, 512), output_len=128)
SMALL_WORKLOAD = dict(num_requests=6, input_range=(8, 24), output_len=6)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of the JSON report")
    parser.add_argument("--hf-requests", type=int, default=64,
                        help="HF generate_batch runs the first N requests (it is slow)")
    parser.add_argument("--small", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--seed", type=int, default=0)


def save_random_mixtral(shape: dict[str, int], folder: Path, seed: int,
                        device: torch.device) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    vocab = shape["vocab_size"]
    config = MixtralConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, bos_token_id=vocab - 2,
                           eos_token_id=vocab - 1, sliding_window=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = MixtralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    free_device_memory()
    save_stand_in_tokenizer(vocab, folder)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve import LLM

    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape, load = (SMALL_SHAPE, SMALL_WORKLOAD) if args.small else (SHAPE, WORKLOAD)
    folder = Path(tempfile.mkdtemp(prefix="pdserve-bench-moe-"))
    report: dict[str, Any] = {"config": config_of(args), "device": str(device), "shape": shape,
                              "systems": {}}
    try:
        log(f"building the random Mixtral in {folder}")
        save_random_mixtral(shape, folder, args.seed, device)
        kwargs: dict[str, Any] = {"max_num_seqs": 256}
        if device.type == "cpu":
            kwargs.update(device="cpu", dtype="bfloat16", kv_cache_memory=32 << 20)
        llm = LLM(str(folder), **kwargs)
        workload = make_workload(llm.get_tokenizer(), load["num_requests"],
                                 load["input_range"], (load["output_len"],) * 2, args.seed)
        report["workload"] = {"requests": len(workload.prompts),
                              "input_tokens": workload.input_tokens,
                              "output_tokens": workload.output_tokens}
        log(f"pdserve: {len(workload.prompts)} requests")
        ours = summarize(bench_pdserve(llm, workload, use_tqdm=False), workload)
        report["systems"]["pdserve"] = {"requests": len(workload.prompts), **ours}
        llm.llm_engine.shutdown()
        del llm
        free_device_memory()
        from engine.model_loader import load_hf_model

        model = load_hf_model(str(folder), torch.bfloat16).to(device)
        cb = subset(workload, min(args.hf_requests, len(workload.prompts)))
        log(f"hf_generate_batch: {len(cb.prompts)} requests")
        measurement, extra = bench_hf_generate_batch(model, cb, None)
        report["systems"]["hf_generate_batch"] = {"requests": len(cb.prompts),
                                                  **summarize(measurement, cb), **extra}
        del model
        report["pdserve_over_hf_generate_batch"] = (
            ours["output_tokens_per_s"]
            / report["systems"]["hf_generate_batch"]["output_tokens_per_s"])
        log(f"pdserve / HF generate_batch: {report['pdserve_over_hf_generate_batch']:.1f}x")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        free_device_memory()
    write_report(report, str(Path(args.out) / "bench_gpu_moe_e2e.json"))
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_moe_e2e", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
