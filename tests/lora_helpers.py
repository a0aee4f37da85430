"""Random PEFT LoRA adapters on disk for the tests, made by PEFT itself (the file format's owner).

`init_lora_weights=False` gives random A and B (PEFT's default zeroes B, an adapter that changes
nothing), so a wrong slice, scale or slot shows in the tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: str | torch.nn.Module, out_dir: Path, *, rank: int = 8,
    targets: tuple[str, ...] = ALL_PROJECTIONS, seed: int = 1, alpha: int | None = None,
    use_rslora: bool = False, scale: float = 1.0,
) -> str:
    """Save a random LoRA adapter of `base` (a HF folder or a HF model, left unchanged) into
    `out_dir` and return its path. `scale` multiplies B after PEFT's random init (a strong
    adapter moves greedy tokens)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if isinstance(base, str):
        base = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    else:
        base = copy.deepcopy(base)
    config = LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
        init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    return str(out_dir)


def peft_model(base: str | torch.nn.Module, adapter_dir: str):
    """HF transformers + PEFT: the oracle for one adapter (fp32, eval; a model given is
    copied, not changed)."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if isinstance(base, str):
        base = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    else:
        base = copy.deepcopy(base)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
