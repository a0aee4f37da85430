"""Prefill service edge: its protobuf messages <-> engine objects."""

from __future__ import annotations

from engine.outputs import CompletionOutput
from pdserve.cluster.convert import LogprobsTuple, logprobs_to_pb
from protos import prefill_pb2


def first_logprobs(c: CompletionOutput) -> LogprobsTuple | None:
    """The first token's (chosen logprob, {top id: logprob}) from an engine output."""
    if not c.logprobs:
        return None
    step, token_id = c.logprobs[0], c.token_ids[0]
    return step[token_id].logprob, {t: lp.logprob for t, lp in step.items() if lp.rank is not None}


def response_to_pb(
    c: CompletionOutput, num_cached_tokens: int, finish_reason: str
) -> prefill_pb2.PrefillResponse:
    msg = prefill_pb2.PrefillResponse(
        first_token_id=c.token_ids[0], num_cached_tokens=num_cached_tokens,
        finish_reason=finish_reason,
    )
    lp = first_logprobs(c)
    if lp is not None:
        msg.first_logprobs.CopyFrom(logprobs_to_pb(lp))
    return msg
