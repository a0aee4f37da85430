"""Quantized weights. Implemented: FP8 (quantized on load, or read from FP8 checkpoints), 4-bit
weights with 16-bit activations (W4A16: AWQ, GPTQ, compressed-tensors pack-quantized
checkpoints) and GGUF kept quantized (CPU and CUDA).

    fp8.py             FP8 weights (per-output-channel scales), their quantizer, `Fp8Linear`
    fp8_checkpoint.py  FP8 checkpoints (vLLM / HF fp8, compressed-tensors FP8): format, weights
    w4a16.py           4-bit weights in one form (codes, group scales and zeros, act-order g_idx)
    w4a16_config.py    which W4A16 format a quantization_config names, and what pdserve refuses
    w4a16_checkpoint.py  AWQ / GPTQ / compressed-tensors tensors -> that form
    w4a16_linear.py    `W4A16Linear`: packs them for the Triton kernel (kernels/w4a16.py) or
                       torch's CPU int4 GEMM
    w4a16_quantize.py  the repository's 4-bit quantizer and writers of the three formats
    gguf_file.py       a GGUF file's tensor table, memory-mapped, without parsing its metadata
    blocks.py          Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks -> codes, scales, biases
    gguf_weights.py    the file's tensors under HF names, q/k rows un-permuted, nothing de-quantized
    kernels.py         the CPU matmuls over them, each with its reference
    gguf_cuda.py       the same on CUDA: the Triton GEMMs of kernels/gguf_q4.py, gguf_q8.py
    layers.py          the linear and embedding modules a Llama-family model builds with them
    factories.py       the projection / embedding / logits a model builds: dense, GGUF, FP8, W4A16

`resolve_quantization` turns the user's `quantization` (vLLM's names) into the engine's.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import IMPLEMENTED_QUANTIZATIONS, QUANTIZATIONS, EngineConfig

NO_QUANTIZATION = "none"  # the user's way to ask for a GGUF de-quantized into the fp cache
# the user's name: its FP8 schemes are served as "fp8", its pack-quantized W4A16 as itself
COMPRESSED_TENSORS = "compressed-tensors"
IMPLEMENTED = IMPLEMENTED_QUANTIZATIONS
W4A16_NAMES = ("awq", "gptq")  # the user's names that need that format's checkpoint


def resolve_quantization(
    requested: str | None, model_path: str, device: str, dtype: str, tensor_parallel_size: int
) -> str | None:
    """EngineConfig.quantization for what the user asked.

    `requested`: None picks from the checkpoint: an FP8 checkpoint (vLLM/HF "fp8" or
    compressed-tensors FP8) is served as "fp8", a W4A16 one as its format ("awq", "gptq",
    "compressed-tensors": engine/quant/w4a16_config.py); a .gguf on the CPU with dtype auto or
    bfloat16, one rank and only supported tensor types is kept quantized ("gguf"; on CUDA only
    when asked for by name); anything
    else loads as before (dtype float32: the GGUF de-quantized into the fp32 cache, what HF
    transformers computes). "none" de-quantizes a GGUF. "fp8" quantizes an unquantized HF
    checkpoint on load (or reads an FP8 one); "awq" / "gptq" need that format's checkpoint;
    "compressed-tensors" needs a compressed-tensors FP8 or W4A16 checkpoint. ValueError for
    other quantized checkpoints, FP8 or W4A16 with tensor parallelism, and "gguf" without a
    .gguf file it can serve. See `quantization_config` for dtype.
    """
    _check_name(requested)
    if Path(model_path).suffix == ".gguf":
        return _resolve_gguf(requested, model_path, device, dtype, tensor_parallel_size)
    from engine.quant.fp8_checkpoint import checkpoint_quantization, fp8_format
    from engine.quant.w4a16_config import w4a16_format

    w4a16 = w4a16_format(checkpoint_quantization(model_path))  # ValueError: cannot serve it
    if w4a16 is not None:
        return _resolve_w4a16(requested, w4a16, model_path, tensor_parallel_size)
    fmt = fp8_format(model_path)  # ValueError for a quantized checkpoint pdserve cannot read
    if requested in W4A16_NAMES:
        what = "unquantized" if fmt is None else f"an FP8 checkpoint ({fmt} format)"
        raise ValueError(f"quantization {requested!r} needs a checkpoint in the {requested} "
                         f"format; {model_path!r} is {what}")
    if requested in (None, NO_QUANTIZATION) and fmt is None:
        return None
    if requested == "gguf":
        raise ValueError(f"quantization 'gguf' needs a .gguf model, got {model_path!r}")
    if requested == NO_QUANTIZATION:
        raise ValueError(f"quantization {NO_QUANTIZATION!r} de-quantizes GGUF files only; "
                         f"{model_path!r} is an FP8 checkpoint ({fmt} format)")
    if requested == COMPRESSED_TENSORS and fmt != COMPRESSED_TENSORS:
        raise ValueError(f"quantization {COMPRESSED_TENSORS!r} needs a compressed-tensors "
                         f"checkpoint; {model_path!r} has format {fmt!r}")
    if tensor_parallel_size > 1:
        raise ValueError("quantization 'fp8' runs on one rank for now (tensor_parallel_size 1)")
    return "fp8"


def _resolve_w4a16(
    requested: str | None, fmt: str, model_path: str, tensor_parallel_size: int
) -> str:
    if requested not in (None, fmt):
        raise ValueError(f"quantization {requested!r} cannot serve {model_path!r}: a {fmt} "
                         "(4-bit W4A16) checkpoint; leave quantization unset or name "
                         f"{fmt!r}")
    if tensor_parallel_size > 1:
        raise ValueError(f"quantization {fmt!r} runs on one rank for now "
                         "(tensor_parallel_size 1)")
    return fmt


def _check_name(requested: str | None) -> None:
    if requested is not None and requested not in (*QUANTIZATIONS, NO_QUANTIZATION):
        raise ValueError(
            f"quantization must be one of {(None, *QUANTIZATIONS)} or "
            f"{NO_QUANTIZATION!r}, got {requested!r}"
        )
    if requested in QUANTIZATIONS and requested not in (*IMPLEMENTED, COMPRESSED_TENSORS):
        raise ValueError(
            f"quantization {requested!r} is not implemented yet (implemented: {IMPLEMENTED})"
        )


def _resolve_gguf(
    requested: str | None, model_path: str, device: str, dtype: str, tensor_parallel_size: int
) -> str | None:
    if requested == NO_QUANTIZATION:
        return None
    if requested in ("fp8", COMPRESSED_TENSORS, *W4A16_NAMES):
        raise ValueError(f"quantization {requested!r} needs an HF folder (safetensors), got "
                         f"the GGUF file {model_path!r}")
    if requested is None:
        # by default on the CPU only: on CUDA the kept-quantized GEMMs (kernels/gguf_q*.py) are
        # not faster than the de-quantized bf16 model yet (docs/benchmarks.md), so they are
        # asked for by name there
        if not (
            dtype in ("auto", "bfloat16")
            and tensor_parallel_size == 1
            and _on_cpu(device)
            and not _unsupported(model_path)
        ):
            return None
    else:
        _check_gguf(model_path, tensor_parallel_size)
    return "gguf"


def quantization_config(config: EngineConfig) -> dict[str, str | None]:
    """What the model's quantized layers read (set as the HF config's `quantization_config`).
    Kept-quantized GGUF with dtype auto: the model runs in fp32, the quantized matmuls take
    bf16 activations (torch's packed int4 CPU kernels); an explicit dtype is used throughout
    (float32: exact de-quantizing matmuls, slow). On CUDA the GGUF kernels take the model's
    dtype (auto: bfloat16) whatever this says. FP8 computes in the model's dtype."""
    gguf_auto = config.quantization == "gguf" and config.dtype == "auto"
    activation = "bfloat16" if gguf_auto else None
    return {"quant_method": config.quantization, "activation_dtype": activation}


def _on_cpu(device: str) -> bool:
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device.startswith("cpu")


def _unsupported(model_path: str) -> list[str]:
    from engine.quant.gguf_weights import unsupported_tensors

    return unsupported_tensors(model_path)


def _check_gguf(model_path: str, tensor_parallel_size: int) -> None:
    if tensor_parallel_size > 1:
        raise ValueError("quantization 'gguf' runs on one rank (tensor_parallel_size 1)")
    if bad := _unsupported(model_path):
        raise ValueError(
            f"GGUF tensors of types pdserve cannot keep quantized: {bad}; "
            f"quantization={NO_QUANTIZATION!r} de-quantizes them"
        )
