"""How many drafts to verify for a request: fewer as its drafts keep being rejected.

NOTE: verifying a draft costs a query token of the target's forward whether it is accepted or
not: next to free at batch 1 on a GPU (the step reads the weights anyway), a real share of the
step where the forward is compute-bound (large batches, the CPU). So a request whose drafts
rarely pass should be asked for fewer, as vLLM and SGLang turn speculation down. Each request
keeps `spec_acceptance`, an exponential moving average of the chance that a draft is accepted
(drafts after the first rejection are not counted: they were never judged). With a per-draft
chance a, draft j is used only if all before it pass, with chance a^j; the policy verifies the
drafts whose chance is at least `MIN_CHANCE` and none when not even the first reaches it, except
one draft every `PROBE_EVERY` steps to notice when the text becomes predictable again.
Torch-free: the scheduler observes, the engine asks.
"""

from __future__ import annotations

from engine.request import Request

MIN_CHANCE = 0.3  # a draft verified below this chance of being used costs more than it gives
WEIGHT = 0.3  # of each verification in the moving average
PROBE_EVERY = 8  # steps without drafts before one is tried again


def observe(req: Request, num_drafts: int, num_accepted: int) -> None:
    """A verification of `num_drafts` drafts, of which the first `num_accepted` passed."""
    judged = num_accepted + (num_accepted < num_drafts)  # the first rejected one was judged
    req.spec_acceptance += WEIGHT * (num_accepted / judged - req.spec_acceptance)


def draft_limit(req: Request, k: int) -> int:
    """How many of up to `k` drafts to verify in `req`'s next step."""
    a, n = req.spec_acceptance, 0
    while n < k and a ** (n + 1) >= MIN_CHANCE:
        n += 1
    if n:
        req.spec_idle_steps = 0
        return n
    req.spec_idle_steps += 1
    if req.spec_idle_steps >= PROBE_EVERY:
        req.spec_idle_steps = 0
        return 1
    return 0
