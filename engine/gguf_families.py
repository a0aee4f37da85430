"""Which GGUF files pdserve reads through transformers' GGUF loader (engine/gguf_cache.py), and
the config values that loader leaves out.

Dense files load as transformers reads them. Of the mixtures of experts, transformers reads two
llama.cpp architectures, each layer's experts stacked in three tensors:

    GGUF architecture   family      per layer
    qwen2moe            Qwen2-MoE   ffn_gate_inp [E, H] (router), ffn_{gate,up}_exps [E, I, H],
                                    ffn_down_exps [E, H, I], shared expert ffn_*_shexp and its
                                    gate ffn_gate_inp_shexp [H]
    qwen3moe            Qwen3-MoE   the same without the shared expert

It de-quantizes them into its fused `experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows)
and `experts.down_proj [E, H, I]`, which pdserve's MoE loader (engine/models/moe.py) reads as
they are. Its config mapping drops the experts' widths, so alone it loads only files of its
config classes' default widths (Qwen1.5-MoE-A2.7B's, Qwen3-30B-A3B's) and fails on others
(Qwen2-57B-A14B, Qwen3-235B-A22B); `config_overrides` reads the widths from the file
(`<arch>.expert_feed_forward_length`, `<arch>.expert_shared_feed_forward_length`) for pdserve
to pass to transformers.

Any other file with a router (`ffn_gate_inp`) is refused, naming its architecture: Mixtral is
llama.cpp's `llama` with experts, which transformers reads as a dense Llama, silently leaving
the MLPs random; `granitemoe` it does not read at all.
"""

from __future__ import annotations

from pathlib import Path

from engine.quant.gguf_file import read_metadata, read_tensors

MOE_ARCHS = {"qwen2moe": "Qwen2-MoE", "qwen3moe": "Qwen3-MoE"}
_KNOWN_MOES = {"llama": "Mixtral", "granitemoe": "GraniteMoE"}
_WIDTHS = {  # GGUF key (after "<arch>.") -> HF config field
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_ARCH = "general.architecture"


def check_gguf_readable(path: str | Path) -> None:
    """ValueError naming the architecture when `path` is a mixture of experts that transformers
    does not read (see the module docstring); nothing otherwise."""
    arch = read_metadata(path, (_ARCH,)).get(_ARCH)
    if arch in MOE_ARCHS or not any(".ffn_gate_inp." in t.name for t in read_tensors(path)):
        return
    family = _KNOWN_MOES.get(str(arch), "a mixture of experts")
    readable = ", ".join(f"{a!r} ({f})" for a, f in MOE_ARCHS.items())
    raise ValueError(
        f"{path}: GGUF architecture {arch!r} with experts ({family}) cannot be loaded: "
        f"transformers' GGUF loader reads mixtures of experts of architectures {readable} "
        "only; serve the model's HF folder instead"
    )


def config_overrides(path: str | Path) -> dict[str, int]:
    """The HF config fields transformers' GGUF mapping drops, as the file states them (empty
    for architectures other than MOE_ARCHS, and for keys the file lacks)."""
    keys = {f"{arch}.{key}": field for arch in MOE_ARCHS for key, field in _WIDTHS.items()}
    found = read_metadata(path, (_ARCH, *keys))
    if found.get(_ARCH) not in MOE_ARCHS:
        return {}
    return {keys[k]: int(v) for k, v in found.items() if k in keys}  # type: ignore[call-overload]
