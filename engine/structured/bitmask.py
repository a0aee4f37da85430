"""The next-token bitmask of constrained rows, in plain torch (the sampler's side).

Layout (xgrammar's): int32 [rows, ceil(V / 32)]; bit b of word w allows token 32 * w + b. A row
of -1 (all bits set) allows everything: the rows of unconstrained requests.
"""

from __future__ import annotations

import torch

_BITS: dict[torch.device, torch.Tensor] = {}  # [32] int32 per device: word bit b set, 1 << b


def _bits(device: torch.device) -> torch.Tensor:
    if device not in _BITS:  # made on the device: a copy from pageable memory would wait for
        # every kernel queued before it (the step's forward pass)
        one = torch.ones(32, dtype=torch.int64, device=device)
        _BITS[device] = (one << torch.arange(32, device=device)).to(torch.int32)  # 1 << 31 wraps
    return _BITS[device]


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: which tokens each row may sample."""
    bits = (bitmask.unsqueeze(-1) & _bits(bitmask.device)) != 0  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [N, V] with every disallowed token at -inf."""
    if logits.is_cuda:  # from pinned memory: the copy does not wait for the queued forward
        if not bitmask.is_pinned():
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    return torch.where(allowed, logits, float("-inf"))
