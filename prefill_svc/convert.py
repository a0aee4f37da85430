"""Prefill service edge: its protobuf messages <-> engine objects."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput, prompt_logprob_entries
from pdserve.cluster.convert import LogprobsTuple, logprobs_to_pb, prompt_logprob_to_pb
from protos import prefill_pb2


def first_logprobs(c: CompletionOutput) -> LogprobsTuple | None:
    """The first token's (chosen logprob, {top id: logprob}) from an engine output."""
    if not c.logprobs:
        return None
    step, token_id = c.logprobs[0], c.token_ids[0]
    return step[token_id].logprob, {t: lp.logprob for t, lp in step.items() if lp.rank is not None}


def response_to_pb(
    out: RequestOutput, finish_reason: str, k: int | None
) -> prefill_pb2.PrefillResponse:
    """The response to a Prefill: its first token, and the prompt's logprobs (top `k`) when
    the engine computed them."""
    c = out.outputs[0]
    msg = prefill_pb2.PrefillResponse(
        first_token_id=c.token_ids[0], num_cached_tokens=out.num_cached_tokens,
        finish_reason=finish_reason,
    )
    lp = first_logprobs(c)
    if lp is not None:
        msg.first_logprobs.CopyFrom(logprobs_to_pb(lp))
    if out.prompt_logprobs is not None and k is not None:
        entries = prompt_logprob_entries(out.prompt_token_ids, out.prompt_logprobs, k)
        msg.prompt_logprobs.extend(
            prompt_logprob_to_pb(t, e) for t, e in zip(out.prompt_token_ids[1:], entries))
    return msg
