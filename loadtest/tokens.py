"""Prompts of an exact token count, as token ids and as the text that encodes back to them.

NOTE: random ids decode to text that rarely re-encodes to the same ids (merges across token
edges), so a text prompt built that way misses its length. We draw from "word tokens" only: ids
whose piece is a space and a lowercase ASCII word (" motor", " arthritis"). A byte-level BPE (or
SentencePiece) tokenizer splits text at spaces before merging, so a run of such tokens
re-encodes to exactly the same ids: the text prompt and the id prompt are the same prompt, and
its length is exact whichever the server is sent. Every prompt is checked by encoding it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

MIN_WORD_TOKENS = 1000
SPACE_MARKERS = ("\u0120", "\u2581")  # byte-level BPE "Ġ", SentencePiece "▁"


def load_tokenizer(name: str | None) -> Any:
    """The HF tokenizer of `name` (a local HF folder or .gguf; None: pdserve's bundled model).
    Uses pdserve's loader where it is installed (GGUF, bundled model), else transformers."""
    try:
        from engine.model_loader import load_tokenizer as pdserve_tokenizer
        from engine.model_loader import resolve_model
    except ImportError:
        if name is None:
            raise ValueError("--tokenizer is needed where pdserve is not installed") from None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    return pdserve_tokenizer(resolve_model(name))


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str


class WordTokens:
    """Seeded random prompts of exact length over a tokenizer's word tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder",
                                                               {}))
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.vocab = [i for i, piece in enumerate(pieces) if i not in special and _is_word(piece)]
        if len(self.vocab) < MIN_WORD_TOKENS:
            raise ValueError(f"the tokenizer has only {len(self.vocab)} word tokens (' word'); "
                             f"random text prompts need {MIN_WORD_TOKENS}")

    def count(self, text: str) -> int:
        """Tokens of `text` without special tokens."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def sample(self, rng: random.Random, length: int, tries: int = 10) -> Prompt:
        """A prompt of exactly `length` tokens. Raises ValueError if none re-encodes exactly."""
        for _ in range(tries):
            ids = rng.choices(self.vocab, k=length)
            text = self.tokenizer.decode(ids)
            if self.tokenizer.encode(text, add_special_tokens=False) == ids:
                return Prompt(ids, text)
        raise ValueError(f"no {length}-token prompt re-encoded to itself in {tries} tries")


def _is_word(piece: str | None) -> bool:
    """A vocabulary piece that is a space marker (byte-level BPE's 'Ġ', SentencePiece's '▁')
    and a lowercase ASCII word of two letters or more."""
    if not piece or piece[0] not in SPACE_MARKERS:
        return False
    word = piece[1:]
    return len(word) >= 2 and word.isascii() and word.isalpha() and word.islower()
