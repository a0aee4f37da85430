"""Logprobs of the prompt's own tokens (`SamplingParams.prompt_logprobs`), as lm-eval's
loglikelihood tasks and OpenAI's `echo` + `logprobs` ask for them.

Position p's hidden state predicts prompt token p + 1: each prefill chunk gives the entries of
the positions it computes, appended to `Request.prompt_logprobs` in order (a recomputed chunk,
after a preemption, adds nothing twice). The logits of a long chunk are made a slice of rows at
a time: [rows, V] in fp32 is the largest temporary.
"""

from __future__ import annotations

import torch

from engine.request import Request

SLICE_ROWS = 256


def add_chunk_prompt_logprobs(
    model: torch.nn.Module, req: Request, hidden: torch.Tensor, chunk_start: int
) -> None:
    """`hidden` [n, hidden]: the chunk's rows, positions [chunk_start, chunk_start + n)."""
    k = req.sampling_params.prompt_logprobs
    assert k is not None
    first = max(chunk_start, len(req.prompt_logprobs))
    last = min(chunk_start + hidden.shape[0], req.num_prompt_tokens - 1)
    for a in range(first, last, SLICE_ROWS):
        b = min(a + SLICE_ROWS, last)
        rows = hidden[a - chunk_start:b - chunk_start]
        targets = torch.tensor(req.prompt_token_ids[a + 1:b + 1], device=rows.device)
        req.prompt_logprobs += token_logprobs(model.compute_logits(rows), targets, k)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> list[tuple[float, int, dict[int, float]]]:
    """Per row of logits [N, V]: the target's logprob, its rank (1 = most likely) and the top k."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])[:, 0]  # [N]
    ranks = (lp > chosen[:, None]).sum(dim=1) + 1
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    rows = zip(chosen.tolist(), ranks.tolist(), top_i.tolist(), top_v.tolist())
    return [(c, r, dict(zip(ids, vals))) for c, r, ids, vals in rows]
