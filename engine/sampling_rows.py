"""Each sampling request's `SamplingRow` and seeded generator, kept by the model runner from the
request's first sampled step until it is released.

A row holds the request's own token lists, which grow in place, so one made at the first step
serves every later one (making a row per request per step was a tenth of a millisecond of a
256-request decode step's host time). A seeded request's generator is made once too: on a
worker taking over a request that sampled elsewhere, it first skips the draws of the tokens
sampled before (`skip_draws`), so the rest of its tokens are those of a run that never moved.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import SamplingRow
from engine.token_choice import skip_draws


class SamplingRows:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rows: dict[str, SamplingRow] = {}
        self._generators: dict[str, torch.Generator] = {}

    def row(self, req: Request) -> SamplingRow:
        row = self._rows.get(req.request_id)
        if row is None or row.output_token_ids is not req.output_token_ids \
                or row.params is not req.sampling_params:  # the id of a request made anew
            row = self._rows[req.request_id] = SamplingRow(
                params=req.sampling_params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                eos_token_ids=req.eos_token_ids,
                generator=self.generator(req),
                bad_words_token_ids=req.bad_words_token_ids,
            )
        return row

    def generator(self, req: Request) -> torch.Generator | None:
        """The request's own generator when it samples with a seed, else None."""
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.greedy:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            skip_draws(gen, req.num_output_tokens)  # tokens sampled before: on another worker
            self._generators[req.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._generators.pop(request_id, None)
