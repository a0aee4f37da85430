"""A model's config.json that transformers wrote, read without importing transformers' config
classes.

Importing a transformers config class costs ~90 MiB of resident memory in an engine process
beyond what the tokenizer imports (torch and triton loaded already): the Llama config pulls in
transformers' activations, its hub-kernels integration and torch's DTensor, hence torch._dynamo
and sympy. A GGUF's cache folders (engine/gguf_cache.py) hold a config.json that
transformers itself saved from the file's metadata, every field of the model's config class
written out; for the dense families below the engine reads nothing from a config beyond those
fields, so that file, read as plain attributes, serves the engine as the config object does.
Other families (the mixtures of experts' configs alias field names through `attribute_map`) and
HF folders (whose config.json may lean on the class defaults) go through `AutoConfig`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# model types whose config class has no attribute aliases and no values computed on load beyond
# what save_pretrained writes (tests/test_saved_config.py compares each with AutoConfig's)
PLAIN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# transformers' base-config fields that save_pretrained leaves out when at their default (and
# the two labels of num_labels = 2, built per config)
BASE_DEFAULTS = {"architectures": None, "dtype": None, "is_encoder_decoder": False,
                 "output_attentions": False, "output_hidden_states": False, "return_dict": True,
                 "chunk_size_feed_forward": 0, "problem_type": None}


class SavedConfig:
    """The fields of a config.json as attributes (BASE_DEFAULTS where absent), and `_name_or_path`
    (the folder) as transformers sets it. Mutable like a transformers config (the loader sets
    `quantization_config`). `dtype` stays the saved name ("float32"), not a torch.dtype: the
    engine takes its dtype from EngineConfig."""

    def __init__(self, fields: dict[str, Any], name_or_path: str) -> None:
        self.__dict__.update(BASE_DEFAULTS)
        self.id2label = {0: "LABEL_0", 1: "LABEL_1"}
        self.label2id = {"LABEL_0": 0, "LABEL_1": 1}
        self.__dict__.update(fields)
        self._name_or_path = name_or_path

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"SavedConfig({self.__dict__!r})"


def read_saved_config(folder: str | Path) -> SavedConfig | None:
    """`folder`'s config.json as a `SavedConfig`, or None when transformers must read it (a model
    type outside PLAIN_MODEL_TYPES, or remote code)."""
    fields = json.loads((Path(folder) / "config.json").read_text())
    if fields.get("model_type") not in PLAIN_MODEL_TYPES or "auto_map" in fields:
        return None
    return SavedConfig(fields, str(folder))
