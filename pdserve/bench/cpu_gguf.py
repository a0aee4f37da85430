"""CPU decode on a GGUF model: kept quantized (engine/quant/) against de-quantized fp32, one run.

    python -m pdserve.bench.cpu_gguf [--model X.gguf] [--threads 2] [--rounds 2]

NOTE: each (variant, round) runs in a fresh subprocess, the variants interleaved round by round,
so that resident memory is that of one engine and a noisy neighbour hurts both alike. A
subprocess builds `LLM(model, kv_cache_memory=--kv-cache-mib, max_model_len=--max-model-len)`
(256 MiB and 1024 by default) and measures:

  load_s         seconds to build the engine (config, tokenizer, weights, KV cache)
  rss_mib        resident memory right after the engine is built (imports, weights, KV cache)
  rss_stages     resident memory after `import torch`, after pdserve's imports, after the engine
                 (pdserve variants: where rss_mib goes)
  weights_mib    bytes the model's modules hold (quantized kernels' packed data, or fp params)
  ms_per_token   single stream, greedy: (time of 1 + N tokens - time of 1 token) / N
  batch_tok_s    `--batch` requests of `--prompt-len` random ids, `--batch-tokens` each, at once:
                 output tokens / wall time (prefill included)

Variants: `gguf` (quantization "gguf", dtype auto = bf16 activations), `fp32` (quantization
"none", dtype float32: the de-quantized path) and `llamacpp` (llama.cpp on the same file, the
peer: pdserve/bench/llamacpp_peer.py; skipped with a note when llama-cpp-python is not
installed; its weights_mib is the file's size: it maps the file). The same seeded prompts
for every variant; `first_tokens` keeps each variant's first greedy tokens of the single stream,
and the report counts how many agree with llama.cpp's. The report holds each round, the medians
and each variant's ratios to llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from pdserve.bench import llamacpp_peer
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.rss_calls import rss_mib

VARIANTS = {"gguf": {"quantization": "gguf"}, "fp32": {"quantization": "none", "dtype": "float32"},
            "llamacpp": {}}
PEER = "llamacpp"
METRICS = ("load_s", "rss_mib", "weights_mib", "ms_per_token", "batch_tok_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled one)")
    parser.add_argument("--variants", default="gguf,fp32,llamacpp",
                        help="comma-separated: gguf, fp32, llamacpp")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="the engine's KV cache")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--output-json", default="bench_results/cpu_gguf.json")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # a subprocess's variant


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return {}
    from engine.model_loader import resolve_model

    args.model = resolve_model(args.model)  # the same file for every variant
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    if PEER in variants and not llamacpp_peer.available():
        print("llamacpp skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
        variants.remove(PEER)
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in rounds:
            result = _subprocess(args, variant)
            rounds[variant].append(result)
            print(f"round {r} {variant}: " + ", ".join(f"{k} {result[k]:.1f}" for k in METRICS))
    medians = {
        v: {k: statistics.median(x[k] for x in rs) for k in METRICS} for v, rs in rounds.items()
    }
    for v, m in medians.items():
        print(f"median {v}: " + ", ".join(f"{k} {m[k]:.1f}" for k in METRICS))
    report = {"config": config_of(args), "rounds": rounds, "medians": medians}
    if PEER in medians:
        report["vs_llamacpp"] = _against_peer(rounds, medians)
        for v, r in report["vs_llamacpp"].items():
            print(f"{v} / llamacpp: " + ", ".join(f"{k} {x:.2f}" for k, x in r.items()))
    write_report(report, args.output_json)
    return report


def _against_peer(rounds: dict[str, list[dict[str, Any]]],
                  medians: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each pdserve variant's speed over llama.cpp's (tok/s ratios: > 1 is faster), memory over
    llama.cpp's, and the share of first greedy tokens equal to llama.cpp's (round 0)."""
    peer, peer_tokens = medians[PEER], rounds[PEER][0]["first_tokens"]
    out = {}
    for v, m in medians.items():
        if v == PEER:
            continue
        mine = rounds[v][0]["first_tokens"]
        same = next((i for i, (a, b) in enumerate(zip(mine, peer_tokens)) if a != b), len(mine))
        out[v] = {
            "single_stream_speed": peer["ms_per_token"] / m["ms_per_token"],
            "batched_speed": m["batch_tok_s"] / peer["batch_tok_s"],
            "rss": m["rss_mib"] / peer["rss_mib"],
            "first_tokens_equal": same,
        }
    return out


def _subprocess(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pdserve.bench.cpu_gguf", "--one", variant]
    for flag in ("model", "threads", "single_tokens", "batch", "batch_tokens", "prompt_len",
                 "kv_cache_mib", "max_model_len"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    out = subprocess.run(
        argv,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _prompts(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    """The single-stream prompt and the batch's, the same for every variant."""
    rng = random.Random(0)
    single = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    batch = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    return single, batch


def _single_and_batched(
    generate: Any, args: argparse.Namespace, vocab: int
) -> tuple[float, float, list[int]]:
    """(ms per token single stream, batched tok/s, the single stream's first tokens) of
    `generate(prompts, tokens) -> token lists`, timed as the NOTE says."""
    prompt, batch = _prompts(args, vocab)

    def timed(prompts: list[list[int]], tokens: int) -> float:
        start = time.perf_counter()
        generate(prompts, tokens)
        return time.perf_counter() - start

    first = generate([prompt], 16)[0]  # warm-up, and the tokens compared across variants
    n = args.single_tokens
    single = min(timed([prompt], 1 + n) - timed([prompt], 1) for _ in range(2)) / n
    batched = args.batch * args.batch_tokens / timed(batch, args.batch_tokens)
    return single * 1e3, batched, first


def measure_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp on the same file: memory after load, single-stream and batched speed. Imports
    nothing of pdserve's engine (torch would count in its resident memory): `args.model` is the
    file's path, resolved by the parent."""
    path = args.model
    start = time.perf_counter()
    peer = llamacpp_peer.LlamaCppPeer(path, args.threads, max(args.batch, 1),
                                      args.prompt_len + max(args.single_tokens + 1,
                                                            args.batch_tokens, 16))
    load_s = time.perf_counter() - start
    rss = rss_mib()
    weights = os.path.getsize(path) / 2**20  # llama.cpp maps the whole file
    single, batched, first = _single_and_batched(peer.generate, args, peer.n_vocab)
    peer.close()
    return {"load_s": load_s, "rss_mib": rss, "weights_mib": weights, "ms_per_token": single,
            "batch_tok_s": batched, "first_tokens": first}


def measure(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """One engine of `variant`: its memory after load, single-stream and batched speed."""
    if variant == PEER:
        return measure_llamacpp(args)
    stages = {"start": rss_mib()}
    import torch

    stages["torch"] = rss_mib()
    from pdserve import LLM, SamplingParams

    stages["pdserve"] = rss_mib()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_mib << 20,
              max_model_len=args.max_model_len, device="cpu", **VARIANTS[variant])
    load_s = time.perf_counter() - start
    rss = stages["engine"] = rss_mib()
    weights = _weights_bytes(llm.llm_engine.runner.model) / 2**20

    def generate(prompts: list[list[int]], tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    single, batched, first = _single_and_batched(generate, args, llm.get_tokenizer().vocab_size)
    return {"load_s": load_s, "rss_mib": rss, "weights_mib": weights, "ms_per_token": single,
            "batch_tok_s": batched, "first_tokens": first, "rss_stages": stages}


def _weights_bytes(model: Any) -> int:
    """Bytes held by the model's weights: quantized modules report theirs, the rest are
    parameters (the quantized modules' empty placeholders count nothing)."""
    held = 0
    for module in model.modules():
        if hasattr(module, "weight_bytes"):
            held += module.weight_bytes()
        held += sum(p.nbytes for p in module.parameters(recurse=False))
    return held


def main(argv: list[str] | None = None) -> int:
    return bench_main("cpu_gguf", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
