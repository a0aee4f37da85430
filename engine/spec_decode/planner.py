"""Each step's drafts: proposed for the decoding requests, cut to those that pay (policy.py), with
the costs measured from the steps the engine runs (step_costs.py)."""

from __future__ import annotations

from engine.request import Request
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode import policy
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.step_costs import StepCosts


class DraftPlanner:
    """The engine calls `propose` before scheduling a step and `measured` once it has its
    outputs."""

    def __init__(self, proposer: NgramProposer | DraftModel,
                 disable_by_batch_size: int | None) -> None:
        self.proposer = proposer
        self.disable_by_batch_size = disable_by_batch_size
        self.costs = StepCosts()
        self.plan = policy.plan_drafts  # a bench that holds every step at k replaces it
        # n-gram proposals cost nothing: a request verifying none is judged on them instead
        self._free = isinstance(proposer, NgramProposer)

    def propose(self, running: list[Request], num_waiting: int) -> None:
        """Set `spec_token_ids` (and `spec_unverified`) of the running requests whose next step
        is a decode (a constrained one's verification masks each position by its grammar
        after the drafts before it)."""
        limit = self.disable_by_batch_size
        if limit is not None and len(running) + num_waiting >= limit:
            return  # a batch this large is compute-bound: drafts would cost, not save
        decoding = [r for r in running if r.num_tokens_to_compute == 1 and not r.num_pending]
        if not decoding:
            return
        proposals = [self.proposer.propose(r) for r in decoding]
        counts = self._counts(running, decoding, proposals)
        for req, drafts, n in zip(decoding, proposals, counts, strict=True):
            if not self._free and drafts:
                n = policy.probe(req, n)
            req.spec_token_ids = drafts[:n]
            req.spec_unverified = drafts[0] if self._free and drafts and not n else None

    def _counts(self, running: list[Request], decoding: list[Request],
                proposals: list[list[int]]) -> list[int]:
        """How many drafts each decoding request verifies: the plan over the batch, except
        for seeded sampled requests (their own history alone: policy.py's NOTE)."""
        own = [policy.own_limit(r.spec_acceptance, len(p)) if _seeded(r) else None
               for r, p in zip(decoding, proposals, strict=True)]
        planned = [len(p) if n is None else 0 for p, n in zip(proposals, own, strict=True)]
        base = sum(r.num_tokens_to_compute for r in running) + sum(n or 0 for n in own)
        counts = self.plan([r.spec_acceptance for r in decoding], planned, base,
                           self.costs.estimate)
        return [c if n is None else n for c, n in zip(counts, own, strict=True)]

    def measured(self, out: SchedulerOutput, seconds: float) -> None:
        """`out` took `seconds` from proposing to its outputs: kept as the cost of its number
        of query tokens when it was decodes and verifications only."""
        steps = out.scheduled
        if steps and all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in steps):
            drafted = any(s.spec_token_ids for s in steps)
            self.costs.observe(out.num_batched_tokens, seconds, drafted)


def _seeded(req: Request) -> bool:
    params = req.sampling_params
    return params.seed is not None and not params.greedy
