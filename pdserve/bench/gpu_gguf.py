"""GGUF kept quantized on CUDA against bf16: batch-1 decode of the random Llama-3.2-1B shape.

    PYTHONPATH=. python -m pdserve.bench.gpu_gguf --out DIR [--small] [--qtype Q4_1]

bf16: the model of `pdserve bench gpu` (gpu_model.py, random bf16 weights). gguf: a GGUF of the
same shape written here with random blocks of `--qtype` (Q4_1 by default: fp16 d and m, random
nibbles; the tied embedding too, norms F32) and a GPT-2-style vocabulary of the same size,
served with quantization "gguf" (engine/quant/gguf_cuda.py). The two models' weights differ
(both random): this times the kernels, not the tokens. Reported per system: decode ms/token
(gpu_generation.measure_latency) and the weights held. JSON goes to DIR/bench_gpu_gguf.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.bench.gpu_generation import measure_latency
from pdserve.bench.gpu_model import (
    SMALL_MODEL,
    ModelShape,
    ModelSizes,
    RandomModel,
    free_device_memory,
    log,
)
from pdserve.bench.report import bench_main, config_of, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results", help="folder of the JSON report")
    parser.add_argument("--qtype", default="Q4_1", help="Q4_0, Q4_1 or Q8_0 (random blocks)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (checks the code)")
    parser.add_argument("--seed", type=int, default=0)


def _byte_chars() -> list[str]:  # GPT-2's printable stand-ins for the 256 bytes
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _random_blocks(qtype: Any, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random codes with weights within ~+-0.02."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_1:  # d, m: w = d * q + m
        raw[:, 0:4] = np.array([[0.003, -0.0225]], np.float16).view(np.uint8)
    else:  # Q4_0 / Q8_0: d
        raw[:, 0:2] = np.array([[0.003 if size == 18 else 0.00015]], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_random_gguf(shape: ModelShape, path: Path, qtype_name: str, seed: int) -> None:
    """A llama GGUF of `shape`, every matrix random blocks of `qtype_name`, tied embeddings."""
    from gguf import GGMLQuantizationType, GGUFWriter

    qtype = GGMLQuantizationType[qtype_name]
    tokens = ["<|endoftext|>", *_byte_chars(), "Ġt", "he"]
    tokens += [f"w{i}" for i in range(shape.vocab - len(tokens))]
    w = GGUFWriter(str(path), "llama")
    for add, value in [
        (w.add_context_length, shape.max_positions), (w.add_embedding_length, shape.hidden),
        (w.add_block_count, shape.layers), (w.add_feed_forward_length, shape.intermediate),
        (w.add_rope_dimension_count, shape.head_dim), (w.add_head_count, shape.heads),
        (w.add_head_count_kv, shape.kv_heads), (w.add_layer_norm_rms_eps, 1e-5),
        (w.add_rope_freq_base, shape.rope_theta), (w.add_vocab_size, shape.vocab),
        (w.add_tokenizer_model, "gpt2"), (w.add_token_list, tokens),
        (w.add_token_types, [3] + [1] * (len(tokens) - 1)),
        (w.add_token_merges, ["Ġ t", "h e"]), (w.add_bos_token_id, 0), (w.add_eos_token_id, 0),
    ]:
        add(value)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, _random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    matrix("token_embd.weight", shape.vocab, h)
    ones = np.ones(h, np.float32)
    for i in range(shape.layers):
        for name, rows, cols in [("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h),
                                 ("attn_output", h, q), ("ffn_gate", shape.intermediate, h),
                                 ("ffn_up", shape.intermediate, h),
                                 ("ffn_down", h, shape.intermediate)]:
            matrix(f"blk.{i}.{name}.weight", rows, cols)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class GGUFModel(RandomModel):
    """`RandomModel`'s interface over a GGUF file (written once, on first use)."""

    def __init__(self, sizes: ModelSizes, device: torch.device, path: Path, qtype: str,
                 seed: int, llm_kwargs: dict[str, Any]) -> None:
        super().__init__(sizes, device, seed, None, llm_kwargs)
        self.path, self.qtype = path, qtype

    @property
    def folder(self) -> str:
        if not self.path.is_file():
            log(f"writing the random {self.qtype} GGUF {self.path}")
            write_random_gguf(self.sizes.shape, self.path, self.qtype, self.seed)
        return str(self.path)


def _held_bytes(llm: Any) -> int:
    from engine.quant.layers import GGUFEmbedding, GGUFLinear

    model = llm.llm_engine.runner.model
    quant = [m for m in model.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))]
    if quant:
        return sum(m.weight_bytes() for m in quant)
    return sum(p.nbytes for p in model.parameters())


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = SMALL_MODEL if args.small else ModelSizes(latency_decode_tokens=64)
    sizes = replace(sizes, latency_repeats=2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kwargs: dict[str, Any] = {"max_num_seqs": 8, "kv_cache_memory": 1 << 30,
                              "max_model_len": min(1024, sizes.shape.max_positions),
                              "dtype": "bfloat16"}
    if device.type == "cpu":
        kwargs.update(device="cpu", kv_cache_memory=8 << 20)
    report: dict[str, Any] = {"config": config_of(args), "device": str(device), "systems": {}}
    folder = Path(tempfile.mkdtemp(prefix="pdserve-bench-gguf-"))
    systems = {"bf16": RandomModel(sizes, device, args.seed, str(folder / "bf16"), kwargs),
               "gguf": GGUFModel(sizes, device, folder / f"random-{args.qtype}.gguf",
                                 args.qtype, args.seed, kwargs)}
    for name, models in systems.items():
        try:
            latency = measure_latency(models, None, args.seed)
            llm = models.llm()
            latency.update(weights_bytes=_held_bytes(llm),
                           quantization=llm.llm_engine.config.quantization)
            log(f"{name}: {latency['ms_per_token']:.3f} ms/token")
            report["systems"][name] = latency
        finally:
            models.remove()
            free_device_memory()
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(report["systems"], indent=2))
    write_report(report, str(Path(args.out) / "bench_gpu_gguf.json"))
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("gpu_gguf", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
