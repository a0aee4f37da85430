"""How many drafts to verify in a step: the ones expected to pay for the rows they add.

NOTE: a verified draft costs a query token of the target's forward whether it passes or not,
and what a token costs depends on the step: next to nothing on a GPU at batch 1, about as much
as a whole decode on the CPU at batch 8 (step_costs.py measures it). So the step is planned as
SmartSpec does (Liu et al. 2024, "goodput"): each request keeps `spec_acceptance`, a moving
average of the chance a that a draft passes (drafts after the first rejection are not counted:
they were never judged), so its draft j (from 0) is used with chance a^(j + 1). Over the batch,
the candidate drafts are sorted by that chance and the m most likely are verified, m maximising

    expected tokens per second = (B + chance of the m drafts) / drafted cost(B + m)

(B: the step's tokens without drafts), and taken only when that beats the step without drafts,
plain cost(B), by PAY_MARGIN: the costs are estimates (step_costs.py: a level that follows the
contexts' growth times a shape per size, drafted and plain steps apart) and the chances are
guesses, so a plan promising a few percent is inside their error (traced on the 2-core CPU box,
free-form prompts at batch 8: steps verifying 6 drafts cost 60 ms against 36 for plain ones
while the averages said 66 against 52, and the speculating engine ran 0.91-0.96x the plain one;
with one average per size for both kinds, verifications of 4-12 drafts cost 36-42 ms where they
were estimated at 32, against 25 for a plain step: 0.90x). A request's drafts are taken in
order, since their chances fall with j. A request given no drafts is still watched: an n-gram
proposal costs nothing to make, so its first draft is compared with the token the step emits
(`judge_unverified`): for a greedy request exactly whether it would have passed, for a sampled
one a draw of that chance (P(token = d) = p(d)). Drafts that cost a forward to make (a draft
model) are not made for it; such a request verifies one draft every `PROBE_EVERY` steps
instead, to notice when its text becomes predictable again.

A seeded sampled request draws two uniforms from its own generator per verified row, so its
tokens depend on how many drafts it verifies: that must not depend on the batch or the clock
(same seed, same tokens). It verifies the drafts whose chance is at least `MIN_CHANCE`, from its
own history alone (`own_limit`). Torch-free: the scheduler observes, the engine asks.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.request import Request

WEIGHT = 0.3  # of each verification in the moving average
MIN_CHANCE = 0.3  # seeded requests: the least chance of being used at which a draft is verified
PROBE_EVERY = 8  # steps without drafts before one is tried again (drafts that are not free)
PAY_MARGIN = 0.1  # the least expected gain in tokens per second for which drafts are verified


def observe(req: Request, num_drafts: int, num_accepted: int) -> None:
    """A verification of `num_drafts` drafts, of which the first `num_accepted` passed."""
    judged = num_accepted + (num_accepted < num_drafts)  # the first rejected one was judged
    req.spec_acceptance += WEIGHT * (num_accepted / judged - req.spec_acceptance)


def judge_unverified(req: Request, token_id: int) -> None:
    """`req`'s step emitted `token_id` without verifying the draft it had been proposed
    (`req.spec_unverified`): observe that draft as if it had been verified."""
    if req.spec_unverified is not None:
        observe(req, 1, int(req.spec_unverified == token_id))
        req.spec_unverified = None


def plan_drafts(
    acceptance: list[float],  # per request, its chance a that a draft passes
    proposed: list[int],  # per request, how many drafts it has
    base_tokens: int,  # the step's query tokens without drafts
    # seconds of a step of T query tokens, verifying drafts or not (None: unknown)
    cost: Callable[[int, bool], float | None],
) -> list[int]:
    """Per request, how many of its drafts to verify (see the NOTE): all when nothing is known
    of the costs yet."""
    chances = sorted(((a ** (j + 1), i) for i, (a, n) in enumerate(zip(acceptance, proposed,
                                                                        strict=True))
                      for j in range(n)), key=lambda c: -c[0])
    base_cost = cost(base_tokens, False)
    if base_cost is None:
        return list(proposed)
    base_rate = base_tokens / base_cost
    best_rate, best_m, gain = base_rate * (1 + PAY_MARGIN), 0, float(base_tokens)
    for m, (chance, _) in enumerate(chances, 1):
        gain += chance
        seconds = cost(base_tokens + m, True) or base_cost
        if gain / seconds > best_rate:
            best_rate, best_m = gain / seconds, m
    counts = [0] * len(proposed)
    for _, i in chances[:best_m]:
        counts[i] += 1
    return counts


def own_limit(acceptance: float, num_drafts: int) -> int:
    """How many of `num_drafts` drafts a seeded request verifies (see the NOTE)."""
    n = 0
    while n < num_drafts and acceptance ** (n + 1) >= MIN_CHANCE:
        n += 1
    return n


def probe(req: Request, num_drafts: int) -> int:
    """`num_drafts` for `req`, or 1 when it has gone `PROBE_EVERY` steps without any (for
    proposers whose drafts cannot be judged unverified)."""
    if num_drafts:
        req.spec_idle_steps = 0
        return num_drafts
    req.spec_idle_steps += 1
    if req.spec_idle_steps >= PROBE_EVERY:
        req.spec_idle_steps = 0
        return 1
    return 0
