"""Incremental detokenization: token ids in, newly completed text out, one step at a time.

NOTE: the prefix-offset / read-offset window (vLLM, TGI). Only the few most recent tokens are
decoded each step, never the whole sequence:

    window  │ context: text already emitted │ new: text not yet emitted │
            0 (prefix offset)           read_offset                len(window)
    new text = decode(window)[len(decode(window[:read_offset])):]

Once the new text is out, the new tokens become the context and older tokens are dropped.
Decoding from the context rather than from `read_offset` gives each new token its left context, so
tokenizers whose decode depends on the previous token (SentencePiece's leading space, bytes that
only form a character together) produce the same text as a decode of the whole sequence.

A character whose UTF-8 bytes span several tokens decodes to U+FFFD until its last byte arrives,
so a trailing run of U+FFFD is held back; text before it goes out at once. A model that really
emits invalid bytes must not stall the stream: after `MAX_HELD_TOKENS` tokens with no progress
the held text goes out as it is, and `flush()` releases it at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context of the first output token (vLLM's value).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so a real one completes within 3 tokens of its first
# byte: 4 tokens without progress means invalid bytes.
MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas.

    Invariant: the concatenated deltas (including `flush()`) equal
    `decode(prompt_tail + output)[len(decode(prompt_tail)):]` with `prompt_tail` the last
    `PROMPT_CONTEXT_TOKENS` prompt tokens (decoded without clean-up of tokenization spaces);
    for byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2, Qwen) that is
    `tokenizer.decode(output_ids)`. SentencePiece tokenizers keep the leading space that the first
    output token has after the prompt, as vLLM does.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # the window
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._emitted = 0  # characters of the window's new text already returned
        self._stalled = 0  # tokens since the window's new text last grew

    def step(self, new_token_ids: list[int]) -> str:
        """Add the tokens sampled since the last call; return the text they complete.

        Holds back a trailing incomplete UTF-8 character (or, after `MAX_HELD_TOKENS` tokens
        without progress, gives up waiting and returns it as U+FFFD)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        pending = self._pending_text()
        held = len(pending) - len(pending.rstrip(REPLACEMENT_CHAR))
        if held == 0:
            # All complete. No text at all (a skipped special token): keep the context, which
            # gives the next token its leading space.
            return self._advance(pending) if pending else ""
        self._stalled = 0 if held < len(pending) else self._stalled + len(new_token_ids)
        if self._stalled >= MAX_HELD_TOKENS:
            return self._advance(pending)
        ready = pending[: len(pending) - held]
        self._emitted += len(ready)
        return ready

    def flush(self) -> str:
        """Return any held-back text as it is (the sequence has finished)."""
        return self._advance(self._pending_text())

    def _pending_text(self) -> str:
        """Text of the tokens after `read_offset` not yet returned."""
        text = self._decode(self._ids)
        return text[len(self._prefix_text) + self._emitted :]

    def _advance(self, pending: str) -> str:
        """Return `pending` and slide the window: what was new becomes the context."""
        del self._ids[: self._read_offset]  # tokens left of the new context are never decoded again
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._emitted = 0
        self._stalled = 0
        return pending

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
