"""The contract between the engine and a grammar engine (xgrammar today; llguidance could be a
second implementation).

The backend compiles a request's constraint once (`compile`, ValueError with the compiler's
message on a bad schema, regex or grammar) and makes one matcher per sequence. A matcher walks
the sequence's output: the engine asks it for the next-token bitmask before each step that
samples, and feeds it every token appended (`accept`). All calls come from the engine thread.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.structured.params import StructuredOutputsParams


class GrammarMatcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) if the grammar forbids it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 bitmask (bitmask.py), all
        of the row's words."""

    def is_terminated(self) -> bool:
        """Whether the output is complete (the grammar accepted a stop token)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""


class GrammarBackend(Protocol):
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint (cached by the caller); ValueError if it does not compile."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the output."""

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        """`matchers[i].fill_bitmask(bitmask, rows[i])` for each i (this backend's matchers,
        none terminated), in as few calls as the backend can: a step's constrained rows. Each
        row is written whole (the caller leaves the buffer uninitialised)."""
