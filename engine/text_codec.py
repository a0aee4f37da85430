"""The engine's own text <-> token ids: the `tokenizers` library alone where it gives what the HF
tokenizer would, so an engine that never needs the rest of HF's tokenizer never loads it.

An engine encodes text prompts and bad words, decodes its outputs, and reads the end-of-sequence
token. For a tokenizer that transformers runs as a plain `tokenizers` backend (tokenizer_config's
`tokenizer_class` "TokenizersBackend" or "PreTrainedTokenizerFast", no `add_bos_token` /
`add_eos_token` that would rewrite its post-processor, no clean-up of spaces), HF's `encode` and
`decode` are the Rust tokenizer's own, so `TextCodec` calls it directly: loading it takes ~0.1 s
and ~40 MB where transformers' import and AutoTokenizer take ~1 s and ~80 MB (the bundled
SmolLM2, 2026-11-29). Everything else (chat templates, the vocabulary for grammars) still goes
through the HF tokenizer, loaded when first asked for (`LLMEngine.tokenizer`). Any other
tokenizer: `load_codec` returns None and the engine encodes and decodes through HF's.
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_BACKENDS = ("TokenizersBackend", "PreTrainedTokenizerFast")
_REWRITING_KEYS = ("add_bos_token", "add_eos_token")


class TextCodec:
    """encode / decode / eos_token_id with HF's fast tokenizer's results (see the docstring)."""

    def __init__(self, tokenizer_json: Path, eos_token: str | None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_json))
        self.eos_token_id = self._tok.token_to_id(eos_token) if eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """`clean_up_tokenization_spaces` is taken for HF's signature: the codec serves only
        tokenizers that do not clean up (`load_codec`)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _special(value: object) -> str | None:
    """A tokenizer_config special token: a string, or an AddedToken dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_codec(folder: str | Path) -> TextCodec | None:
    """The codec of a tokenizer folder, or None where HF's tokenizer must do the work."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if (not (folder / "tokenizer.json").is_file()
            or config.get("tokenizer_class") not in PLAIN_BACKENDS
            or any(config.get(key) for key in _REWRITING_KEYS)
            or config.get("clean_up_tokenization_spaces")):
        return None
    return TextCodec(folder / "tokenizer.json", _special(config.get("eos_token")))
