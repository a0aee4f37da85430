"""Quantized weights. Implemented: GGUF kept quantized on the CPU.

    gguf_file.py     a GGUF file's tensor table, memory-mapped, without parsing its metadata
    blocks.py        Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks -> codes, scales, biases
    gguf_weights.py  the file's tensors under HF names, q/k rows un-permuted, nothing de-quantized
    kernels.py       the CPU matmuls over them, each with its reference
    layers.py        the linear and embedding modules a Llama-family model builds with them

`resolve_quantization` turns the user's `quantization` (vLLM's names) into the engine's.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import IMPLEMENTED_QUANTIZATIONS, QUANTIZATIONS, EngineConfig

NO_QUANTIZATION = "none"  # the user's way to ask for a GGUF de-quantized into the fp cache
IMPLEMENTED = IMPLEMENTED_QUANTIZATIONS


def resolve_quantization(
    requested: str | None, model_path: str, device: str, dtype: str, tensor_parallel_size: int
) -> str | None:
    """EngineConfig.quantization for what the user asked.

    `requested`: None picks from the checkpoint: a .gguf on the CPU with dtype auto or
    bfloat16, one rank and only supported tensor types is kept quantized ("gguf"); anything
    else loads as before (dtype float32: the GGUF de-quantized into the fp32 cache, what HF
    transformers computes). "none" always de-quantizes. "gguf" requires a .gguf file it can
    serve, else ValueError. See `quantization_config` for what dtype means then.
    """
    if requested == NO_QUANTIZATION:
        return None
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {(None, *QUANTIZATIONS)} or "
            f"{NO_QUANTIZATION!r}, got {requested!r}"
        )
    if requested is not None and requested not in IMPLEMENTED:
        raise ValueError(
            f"quantization {requested!r} is not implemented yet (implemented: {IMPLEMENTED})"
        )
    is_gguf = Path(model_path).suffix == ".gguf"
    if requested is None:
        if not (
            is_gguf
            and dtype in ("auto", "bfloat16")
            and tensor_parallel_size == 1
            and _on_cpu(device)
            and not _unsupported(model_path)
        ):
            return None
    else:
        _check_gguf(model_path, is_gguf, device, tensor_parallel_size)
    return "gguf"


def quantization_config(config: EngineConfig) -> dict[str, str | None]:
    """What the model's quantized layers read (set as the HF config's `quantization_config`).
    Kept-quantized GGUF with dtype auto: the model runs in fp32, the quantized matmuls take
    bf16 activations (torch's packed int4 CPU kernels); an explicit dtype is used throughout
    (float32: exact de-quantizing matmuls, slow)."""
    activation = "bfloat16" if config.dtype == "auto" else None
    return {"quant_method": config.quantization, "activation_dtype": activation}


def _on_cpu(device: str) -> bool:
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device.startswith("cpu")


def _unsupported(model_path: str) -> list[str]:
    from engine.quant.gguf_weights import unsupported_tensors

    return unsupported_tensors(model_path)


def _check_gguf(model_path: str, is_gguf: bool, device: str, tensor_parallel_size: int) -> None:
    if not is_gguf:
        raise ValueError(f"quantization 'gguf' needs a .gguf model, got {model_path!r}")
    if not _on_cpu(device):
        raise ValueError(
            "quantization 'gguf' (kept quantized) runs on the CPU only for now; "
            f"quantization={NO_QUANTIZATION!r} de-quantizes the GGUF instead"
        )
    if tensor_parallel_size > 1:
        raise ValueError("quantization 'gguf' runs on one rank (tensor_parallel_size 1)")
    if bad := _unsupported(model_path):
        raise ValueError(
            f"GGUF tensors of types pdserve cannot keep quantized: {bad}; "
            f"quantization={NO_QUANTIZATION!r} de-quantizes them"
        )
