"""The engine's structured outputs: compile each constraint once (an LRU cache keyed by its kind
and text), give each sequence its matcher, and build a step's bitmask.

NOTE: a step's bitmask is filled on the host after its forward pass is queued, and after the
tokens of the step before are appended (asynchronous scheduling launches step N+1 before N's
tokens are in: the engine appends them, then starts N+1's sampling, engine/model_runner.py
`LaunchedStep`), so on a GPU the fill runs while the forward does. The sampler applies it to
the logits before temperature, top-k/p and penalties, so logprobs come from the constrained
distribution (vLLM's order).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.structured.backend import GrammarBackend, GrammarMatcher
from engine.structured.bitmask import bitmask_words
from engine.structured.params import StructuredOutputsParams

_CACHE_SIZE = 256


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    bitmask_seconds: float = 0.0  # filling step bitmasks on the host


class StructuredOutputs:
    def __init__(self, backend: GrammarBackend, vocab_size: int) -> None:
        self.backend, self.vocab_size = backend, vocab_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.stats = GrammarStats()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> StructuredOutputs:
        from engine.structured.xgrammar_backend import XGrammarBackend

        return cls(XGrammarBackend(tokenizer, vocab_size, sorted(eos_token_ids)), vocab_size)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint (ValueError naming the field if it does not compile)."""
        key = (params.kind, params.spec())
        if key in self._cache:
            self.stats.cache_hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        start = time.perf_counter()
        compiled = self.backend.compile(params)
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.compiles += 1
        self._cache[key] = compiled
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any, prior_token_ids: list[int]) -> GrammarMatcher:
        """A matcher past `prior_token_ids` (tokens generated before, elsewhere); ValueError if
        they do not follow the grammar."""
        m = self.backend.matcher(compiled)
        for i, token_id in enumerate(prior_token_ids):
            if not m.accept(token_id):
                raise ValueError(f"output token {i} ({token_id}) does not follow the grammar")
        return m

    def draft_bitmask(
        self, matchers: list[GrammarMatcher | None], drafts: list[list[int]]
    ) -> torch.Tensor | None:
        """int32 [sum(k + 1), words]: for a request verifying k drafts, the tokens allowed
        after its output and after each prefix of its drafts (the matcher walks the drafts and
        is rolled back); -1 (anything) for unconstrained requests and for the rows after a
        draft the grammar refuses or after the grammar ends (never sampled: verification stops
        at that draft). None when no request is constrained."""
        if all(m is None for m in matchers):
            return None
        start = time.perf_counter()
        rows = sum(len(d) + 1 for d in drafts)
        mask = torch.full((rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        row = 0
        for m, d in zip(matchers, drafts, strict=True):
            walked = 0
            while m is not None and not m.is_terminated():
                m.fill_bitmask(mask, row + walked)
                if walked == len(d) or not m.accept(d[walked]):
                    break
                walked += 1
            if walked:
                m.rollback(walked)  # type: ignore[union-attr]
            row += len(d) + 1
        self.stats.bitmask_seconds += time.perf_counter() - start
        return mask

    def bitmask(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor | None:
        """int32 [rows, words]: each constrained row's allowed tokens, -1 for the others; None
        when no row is constrained. A finished grammar's row (its request ended with the step
        before; the row's token is discarded) allows everything."""
        if all(m is None for m in matchers):
            return None
        start = time.perf_counter()
        mask = torch.full((len(matchers), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        for row, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_bitmask(mask, row)
        self.stats.bitmask_seconds += time.perf_counter() - start
        return mask
