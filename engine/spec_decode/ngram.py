"""N-gram (prompt lookup) proposer: the tokens that followed the last time the sequence's end
occurred earlier in its prompt or output.

NOTE: with tokens t[0..L-1], find the longest n in [min_n, max_n] such that the suffix
t[L-n..L-1] also ends at an earlier position e < L-1; among those, take the most recent e, and
propose t[e+1 .. e+k] (fewer when the sequence ends first). Vectorised over the candidates:

    candidates e:  t[e] == t[L-1], e < L-1          (one comparison over the sequence)
    step j = 1..max_n-1:  alive &= t[e-j] == t[L-1-j]; length += alive
    best = max length (>= min_n), the largest e with it

Each request's tokens live in a numpy buffer that grows as tokens are appended, so a step costs
one pass over the sequence plus max_n passes over the candidates, not a list conversion.
"""

from __future__ import annotations

import numpy as np

from engine.config import SpeculativeConfig
from engine.request import Request


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens following the most recent earlier match of the longest suffix n-gram of
    `tokens` [L] (min_n <= n <= max_n); [] when no suffix of min_n tokens occurs earlier."""
    length = tokens.shape[0]
    if length <= min_n:
        return []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C] candidate ends
    if ends.size == 0:
        return []
    matched = np.ones(ends.shape[0], dtype=np.int64)  # [C] suffix tokens matched so far
    alive = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, min(max_n, length)):
        alive &= ends >= j
        alive[alive] = tokens[ends[alive] - j] == tokens[length - 1 - j]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])
    return tokens[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    """Proposes for each request from its prompt + output tokens; keeps a token buffer per
    request (drop it with `forget` when the request ends)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.k = config.num_speculative_tokens or 0
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, length)

    def propose(self, req: Request) -> list[int]:
        """Draft tokens to follow `req`'s last token (at most k; maybe none)."""
        return propose_ngram(self._tokens(req), self.min_n, self.max_n, self.k)

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    def _tokens(self, req: Request) -> np.ndarray:
        """`req`'s tokens as a view of its buffer, extended by the tokens appended since."""
        buf, n = self._buffers.get(req.request_id, (None, 0))
        total = req.num_tokens
        if buf is None or buf.shape[0] < total:
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if n < total:
            buf[n:total] = req.token_ids_slice(n, total)
        self._buffers[req.request_id] = (buf, total)
        return buf[:total]
