"""A GGUF file, de-quantized once into an HF safetensors folder that later loads read in ~1 s.

De-quantizing through transformers takes ~20 s for SmolLM2-135M (most of it parsing the GGUF
metadata in Python), so the first load converts and every later one reads the cache:

    <cache root>/<gguf basename>-<size>-<mtime_ns>/
        config.json  generation_config.json  model.safetensors   (fp32, tied lm_head omitted)
        tokenizer.json  tokenizer_config.json  chat_template.jinja

A model kept quantized (engine/quant/) needs no de-quantized weights, only the config and the
tokenizer: `ensure_gguf_metadata` writes those alone, once, into `<...>-<mtime_ns>-meta/`.

Mixtures of experts convert the same way where transformers reads them (Qwen2-MoE, Qwen3-MoE:
their stacked experts arrive as transformers' fused expert tensors); other files with experts
are refused before anything is written (engine/gguf_families.py).

The cache root is kernels/cache_root.py's (`$PDSERVE_CACHE_DIR`, else
`$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`), read when called. The folder
name changes whenever the GGUF file is replaced, so a stale entry is never read. A conversion is
written into a temporary sibling folder and renamed into place: other processes see either no
folder or a complete one. Two processes converting at once both succeed; the later rename loses
and its copy is deleted.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from engine.gguf_families import check_gguf_readable, config_overrides
from kernels.cache_root import cache_root as machine_cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def default_cache_root() -> Path:
    """kernels/cache_root.py's folder (read at call time, not import)."""
    return Path(machine_cache_root())  # (this module's functions take a `cache_root` argument)


def gguf_cache_dir(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """The cache folder for `gguf_path`; it exists only once a conversion has finished."""
    path = Path(gguf_path)
    stat = path.stat()
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}"


def cached_gguf_dir(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path | None:
    """The finished cache folder for `gguf_path`, or None when it has not been converted yet."""
    folder = gguf_cache_dir(gguf_path, cache_root)
    return folder if (folder / "config.json").is_file() else None


def ensure_gguf_converted(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """Return the cache folder for `gguf_path`, converting the GGUF first if needed.

    Side effects: on a miss, de-quantizes the whole model in fp32 through transformers (the same
    tensors `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` holds, given the config
    fields its GGUF mapping drops) and writes the folder atomically under the cache root. Never
    touches the network. ValueError for a mixture of experts transformers does not read.
    """
    return _build_once(gguf_cache_dir(gguf_path, cache_root), Path(gguf_path), _convert)


def gguf_metadata_dir(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """The metadata-only cache folder for `gguf_path` (config and tokenizer, no weights)."""
    folder = gguf_cache_dir(gguf_path, cache_root)
    return folder.with_name(folder.name + "-meta")


def ensure_gguf_metadata(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """The folder holding `gguf_path`'s config and tokenizer as transformers saves them,
    written once (parsing the GGUF's metadata in Python takes seconds), atomically like the
    full cache."""
    return _build_once(gguf_metadata_dir(gguf_path, cache_root), Path(gguf_path),
                       _convert_metadata)


def _build_once(folder: Path, gguf_path: Path, convert: Callable[[Path, Path], None]) -> Path:
    """`folder` once its config.json exists; else `convert(gguf_path, tmp)` into a temporary
    sibling, published atomically (`_publish`)."""
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        convert(gguf_path, tmp)
        _publish(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _transformers_kwargs(gguf_path: Path) -> tuple[dict, dict[str, int]]:
    """(from_pretrained's GGUF arguments, the config fields transformers' GGUF mapping drops);
    ValueError naming the architecture for a file transformers does not read
    (engine/gguf_families.py)."""
    check_gguf_readable(gguf_path)
    return {"gguf_file": gguf_path.name, "local_files_only": True}, config_overrides(gguf_path)


def _convert_metadata(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    kwargs, overrides = _transformers_kwargs(gguf_path)
    AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs).save_pretrained(out_dir)
    config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs, **overrides)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)  # last: its config.json marks the folder complete


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Write transformers' de-quantized fp32 model and tokenizer for `gguf_path` into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs, overrides = _transformers_kwargs(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, **kwargs, **overrides
    )
    _save_plain(model, out_dir)
    del model
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    tokenizer.save_pretrained(out_dir)


def _save_plain(model: PreTrainedModel, out_dir: Path) -> None:
    """Save `model` as an unquantized HF folder. (save_pretrained refuses GGUF-loaded models.)"""
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embeddings
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)


def _publish(tmp: Path, folder: Path) -> None:
    """Make `tmp` world-readable and rename it to `folder`; if another process published first,
    keep theirs (the caller deletes `tmp`)."""
    for file in tmp.iterdir():
        file.chmod(0o644)
    tmp.chmod(0o755)  # mkdtemp made it private
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():
            raise
