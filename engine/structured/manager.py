"""The engine's structured outputs: compile each constraint once (an LRU cache keyed by its kind
and text), give each sequence its matcher, and build a step's bitmask.

NOTE: asynchronous scheduling launches step N+1 before N's tokens are in, and a constrained row
of N+1 can be masked only once its matcher has accepted N's token. So a constrained step queues
its forward pass alone (engine/model_runner.py `LaunchedStep`); when N's tokens land, the engine
appends them (which advances the matchers) and at once fills N+1's bitmask here and queues N+1's
sampling, and only then detokenizes and makes N's outputs (engine/llm_engine.py `step`): only
appending and the grammar's work stand between N's tokens and N+1's sampling on the host. The
fill is one backend call for all rows, into pinned memory on a GPU (the copy does not wait for
the queued forward). The sampler applies the mask before temperature, top-k/p and penalties, so
logprobs come from the constrained distribution (vLLM's order).
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
    def __init__(self, backend: GrammarBackend, vocab_size: int, pin_memory: bool = False) -> None:
        self.backend, self.vocab_size = backend, vocab_size
        self.pin_memory = pin_memory  # step bitmasks in pinned host memory (a CUDA device)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.stats = GrammarStats()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
        pin_memory: bool = False,
    ) -> StructuredOutputs:
        from engine.structured.xgrammar_backend import XGrammarBackend

        return cls(XGrammarBackend(tokenizer, vocab_size, sorted(eos_token_ids)), vocab_size,
                   pin_memory)

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
        mask = self._new_mask(rows)
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
        mask = self._new_mask(len(matchers), fill=False)  # the backend writes whole rows
        live, rows, others = [], [], []
        for row, m in enumerate(matchers):
            if m is None or m.is_terminated():
                others.append(row)
            else:
                live.append(m)
                rows.append(row)
        if live:
            self.backend.fill_bitmasks(live, mask, rows)
        if others:
            mask.numpy()[others] = -1  # numpy: one thread (torch would wake its pool)
        self.stats.bitmask_seconds += time.perf_counter() - start
        return mask

    def _new_mask(self, rows: int, fill: bool = True) -> torch.Tensor:
        """int32 [rows, words], of -1 if `fill`; pinned where the mask goes to a GPU (the
        caching host allocator reuses a block once the copy that read it has run)."""
        mask = torch.empty((rows, bitmask_words(self.vocab_size)), dtype=torch.int32,
                           pin_memory=self.pin_memory)
        if fill:
            mask.numpy().fill(-1)
        return mask
