"""The tiny-model set-up the quantization tests share (test_quant_fp8.py, test_quant_w4a16.py): a
small CPU engine's options, its prompts and greedy tokens, a model folder with its weights
replaced, and the relative error a kernel is held to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve import LLM, SamplingParams

SMALL = dict(num_kv_blocks=32, max_model_len=128, device="cpu", dtype="float32")
PROMPTS = [[5, 17, 42, 9], [100, 3, 77], [250, 251, 252, 253, 254], [1, 2]]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def random_w4a16_layout(k: int, n: int, group: int, seed: int):
    """kernels/w4a16.py's layout of random codes, scales and zeros (0..16: GPTQ v1's reach):
    (qweight [K / 8, N], scales [K / G, N] fp32, zeros [K / G, N] uint8)."""
    from kernels.w4a16 import pack_rows

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 17, (k // group, n), generator=gen).to(torch.uint8)
    return pack_rows(codes), scales, zeros


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS, n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def copy_model(src: str, dst: Path, tensors: dict[str, torch.Tensor],
               qc: dict | None = None) -> str:
    """`src` with its weights replaced by `tensors` (one model.safetensors) and, given `qc`,
    config.json's quantization_config."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    if qc is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = qc
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)
