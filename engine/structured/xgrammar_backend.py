"""Structured outputs through xgrammar (vLLM's default backend).

JSON schemas compile to compact JSON (no free whitespace: a small model given free whitespace
can spend its whole budget on newlines); `json_object` is the schema {"type": "object"}; a
choice is an EBNF alternation of the literal strings.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from engine.structured.params import StructuredOutputsParams

_SOURCE = re.compile(r"\[[0-9:]+\] \S+\.cc:\d+: ")


class XGrammarMatcher:
    """One sequence's xgrammar matcher. Whether it is terminated is kept here: it changes only
    when a stop token is accepted or tokens are rolled back, and asking xgrammar costs a call
    per row and step."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: frozenset[int]) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._stops = stop_token_ids
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        accepted = bool(self._m.accept_token(token_id))
        if accepted and token_id in self._stops:
            self._terminated = bool(self._m.is_terminated())
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        self._terminated = bool(self._m.is_terminated())


class XGrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)
        self._stops = frozenset(info.stop_token_ids)
        # one call fills a step's rows, in one thread: on the H100 host 64 rows took 0.09 ms
        # so, 0.20 as 64 calls, 0.26 / 1.1 / 4.0 with xgrammar's pool of 2 / 4 / 8 threads
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return self._compile(params)
        except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as exc:
            message = _SOURCE.sub("", str(exc)).strip()  # "[12:00:00] /project/cpp/x.cc:83: "
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {message}") \
                from None

    def _compile(self, p: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self._compiler
        if p.json is not None:
            schema = json.loads(p.json) if isinstance(p.json, str) else p.json
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return c.compile_json_schema(json.dumps(schema), any_whitespace=False)
        if p.json_object:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if p.regex is not None:
            return c.compile_regex(p.regex)
        if p.choice is not None:
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in p.choice))
        return c.compile_grammar(str(p.grammar))

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, self._stops)

    def fill_bitmasks(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)
