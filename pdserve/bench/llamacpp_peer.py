"""llama.cpp as the CPU peer of `pdserve bench cpu-gguf`: the same GGUF file, greedy, through
llama-cpp-python's C API (optional: `pip install llama-cpp-python` compiles llama.cpp).

NOTE: one llama.cpp context serves a whole measurement the way pdserve's engine does: `n_seq_max`
sequences share one unified KV cache of `n_ctx` cells, each sequence its own id. A generation
decodes every prompt in one `llama_decode` call (only each prompt's last position asks for
logits), then one call per step with one token per sequence, each next token the argmax of its
row of logits (ignore_eos: every sequence makes the same number of tokens). Before a generation
the cache is cleared, so no prompt is reused from an earlier one.

    prefill   batch = [p0 t0..tn | p1 t0..tn | ...]   logits at each prompt's last token
    step      batch = [s0 | s1 | ...]                 one token per sequence, logits for each
"""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Any

import numpy as np


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer:
    """A llama.cpp model and context for up to `max_seqs` sequences of `max_len` tokens each."""

    def __init__(self, model_path: str, threads: int, max_seqs: int, max_len: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(model_path.encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {model_path!r}")
        params = lc.llama_context_default_params()
        params.n_ctx = max_seqs * max_len
        params.n_batch = params.n_ubatch = max_seqs * max_len
        params.n_seq_max = max_seqs
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise ValueError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.capacity = max_seqs * max_len
        self.batch = lc.llama_batch_init(self.capacity, 0, max_seqs)

    def generate(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        """Greedy `tokens` new tokens for each prompt, all sequences decoded together."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        rows = self._fill([(p, s, 0, True) for s, p in enumerate(prompts)])
        out: list[list[int]] = [[] for _ in prompts]
        positions = [len(p) for p in prompts]
        for step in range(tokens):
            self._decode()
            nexts = [self._argmax(row) for row in rows]
            for s, tok in enumerate(nexts):
                out[s].append(tok)
            if step + 1 == tokens:
                break
            rows = self._fill([([tok], s, positions[s], True) for s, tok in enumerate(nexts)])
            positions = [p + 1 for p in positions]
        return out

    def _fill(self, seqs: list[tuple[list[int], int, int, bool]]) -> list[int]:
        """Put (tokens, seq id, first position, logits at the last) entries into the batch;
        returns the batch rows whose logits will be read, one per entry."""
        b, i, rows = self.batch, 0, []
        for toks, seq, start, want in seqs:
            for j, tok in enumerate(toks):
                if i >= self.capacity:
                    raise ValueError(f"batch of more than {self.capacity} tokens")
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, start + j, 1
                b.seq_id[i][0] = seq
                b.logits[i] = want and j == len(toks) - 1
                i += 1
            rows.append(i - 1)
        b.n_tokens = i
        return rows

    def _decode(self) -> None:
        status = self.lc.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _argmax(self, row: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, row)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                       shape=(self.n_vocab,))
        return int(logits.argmax())

    def close(self) -> None:
        lc: Any = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)
