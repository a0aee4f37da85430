"""Protobuf <-> engine conversions shared by the workers and the gateway's gRPC backend.

Each service's own converter module handles its own messages; the messages several services
share (sampling parameters, logprobs, load) convert here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.lora import LoRARequest
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler_output import SchedulerStats
from engine.structured.params import StructuredOutputsParams
from protos import common_pb2, prefill_pb2

LogprobsTuple = tuple[float, dict[int, float]]
# A prompt position's (its token's logprob, rank, {top id: logprob}): engine.outputs'
PromptLogprobTuple = tuple[float, int, dict[int, float]]


def sampling_params_to_pb(p: SamplingParams, max_tokens: int) -> common_pb2.SamplingParams:
    """Token-level sampling rules for one sequence; stop strings stay with the gateway."""
    msg = common_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.structured_outputs is not None:
        msg.structured_output.CopyFrom(structured_output_to_pb(p.structured_outputs))
    msg.logit_bias.update(p.logit_bias or {})
    msg.allowed_token_ids.extend(p.allowed_token_ids or [])
    msg.bad_words.extend(p.bad_words or [])
    return msg


def sampling_params_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validated engine params (ValueError names the field) that stream token deltas only."""
    if msg.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {msg.max_tokens}")
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty,
        max_tokens=msg.max_tokens,
        min_tokens=min(msg.min_tokens, msg.max_tokens),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=(structured_output_from_pb(msg.structured_output)
                            if msg.HasField("structured_output") else None),
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words=list(msg.bad_words) or None,
    )


def structured_output_to_pb(so: StructuredOutputsParams) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(kind=so.kind, spec=so.spec())


def structured_output_from_pb(msg: common_pb2.StructuredOutput) -> StructuredOutputsParams:
    """The constraint (ValueError for an unknown kind or a spec that does not fit it; whether
    it compiles is the engine's to say, when the request is added)."""
    try:
        return StructuredOutputsParams.from_spec(msg.kind, msg.spec)
    except RecursionError:  # a choice list nested past json's recursion limit
        raise ValueError("structured_output.spec is nested too deeply") from None


def logprobs_to_pb(lp: LogprobsTuple) -> common_pb2.TokenLogprobs:
    chosen, top = lp
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return common_pb2.TokenLogprobs(
        logprob=chosen,
        top_token_ids=[t for t, _ in ranked],
        top_logprobs=[v for _, v in ranked],
    )


def logprobs_from_pb(msg: common_pb2.TokenLogprobs) -> LogprobsTuple:
    return msg.logprob, dict(zip(msg.top_token_ids, msg.top_logprobs))


def prompt_logprob_to_pb(
    token_id: int, entry: PromptLogprobTuple
) -> prefill_pb2.PromptTokenLogprob:
    chosen, rank, top = entry
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return prefill_pb2.PromptTokenLogprob(
        token_id=token_id, logprob=chosen, rank=rank,
        top_token_ids=[t for t, _ in ranked], top_logprobs=[v for _, v in ranked],
    )


def prompt_logprobs_from_pb(
    msgs: Iterable[prefill_pb2.PromptTokenLogprob],
) -> list[PromptLogprobTuple]:
    """The prefill worker's prompt logprobs, one per prompt position after the first."""
    return [(m.logprob, m.rank, dict(zip(m.top_token_ids, m.top_logprobs))) for m in msgs]


def load_to_pb(role: str, stats: SchedulerStats) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        role=role,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
    )


def lora_to_pb(lora: LoRARequest) -> common_pb2.LoRAAdapter:
    return common_pb2.LoRAAdapter(name=lora.lora_name, int_id=lora.lora_int_id,
                                  path=lora.lora_path)


def lora_from_pb(msg: common_pb2.LoRAAdapter) -> LoRARequest:
    """The adapter a message names (ValueError for an empty name or path); an int_id of 0
    (a client that left it out) gets the name's own id."""
    from pdserve.cluster.lora import lora_int_id

    return LoRARequest(msg.name, msg.int_id or lora_int_id(msg.name), msg.path)


def request_lora(request: Any) -> LoRARequest | None:
    """A PrefillRequest's or GenerateRequest's adapter; None for the base model."""
    return lora_from_pb(request.lora) if request.HasField("lora") else None
