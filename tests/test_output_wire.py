"""engine/output_wire.py: a RequestOutput with every field set crosses as a tuple and comes back
equal; the tuple's fields are the dataclasses' (a field added there fails here first)."""

from __future__ import annotations

import dataclasses
import pickle

from engine import output_wire
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _full() -> RequestOutput:
    return RequestOutput(
        "r1", "a prompt", [5, 6, 7],
        [CompletionOutput(0, "hi", [9, 10], "stop", "\n", [{9: Logprob(-0.5, 1, "h")},
                                                           {10: Logprob(-1.5, 2)}], -2.0),
         CompletionOutput(1, "", [], None)],
        finished=True, metrics=RequestMetrics(1.0, 2.0, 3.0, 4.0, 5, 6), num_cached_tokens=16,
        prompt_logprobs=[None, {6: Logprob(-3.0, 4)}, {7: Logprob(-0.1, 1)}])


def test_every_field_crosses_and_comes_back_equal() -> None:
    out = _full()
    assert output_wire.decode(pickle.loads(pickle.dumps(output_wire.encode(out)))) == out
    bare = RequestOutput("r2", None, [1], [CompletionOutput(0, "", [3])])
    assert output_wire.decode(output_wire.encode(bare)) == bare


def test_without_prompt_ids_they_cross_as_none() -> None:
    back = output_wire.decode(output_wire.without_prompt_ids(output_wire.encode(_full())))
    assert back.prompt_token_ids is None
    assert dataclasses.replace(back, prompt_token_ids=[5, 6, 7]) == _full()


def test_the_tuples_hold_every_dataclass_field() -> None:
    wire = output_wire.encode(_full())
    assert len(wire) == len(dataclasses.fields(RequestOutput))
    assert len(wire[3][0]) == len(dataclasses.fields(CompletionOutput))
    assert len(wire[5]) == len(dataclasses.fields(RequestMetrics))


def test_without_prompt_ids_leaves_only_them_out() -> None:
    wire = output_wire.encode(_full())
    bare = output_wire.without_prompt_ids(wire)
    assert bare[output_wire.PROMPT_IDS] is None and wire[output_wire.PROMPT_IDS] == [5, 6, 7]
    assert bare[:output_wire.PROMPT_IDS] + bare[output_wire.PROMPT_IDS + 1:] == (
        wire[:output_wire.PROMPT_IDS] + wire[output_wire.PROMPT_IDS + 1:])
    assert wire[output_wire.REQUEST_ID] == "r1" and wire[output_wire.FINISHED] is True


def test_a_group_builds_the_tuple_its_output_encodes_to() -> None:
    """RequestGroup.make_wire (what the engine core process sends) is make_output's encoding:
    the tuple's fields in the dataclasses' order, for one sequence and for n > 1."""
    from engine.output_processor import RequestGroup, SequenceState
    from engine.request import Request, RequestStatus
    from engine.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=4, n=2, logprobs=1, output_kind=RequestOutputKind.DELTA)
    reqs = [Request(f"r-{i}", [5, 6, 7], params, parent_id="r", index=i) for i in range(2)]
    for i, req in enumerate(reqs):
        req.append_token(9 + i, (-0.5, {9 + i: -0.5}))
        req.metrics.first_token_time = 3.0 + i
    reqs[1].status = RequestStatus.FINISHED_LENGTH
    def group(seqs: list[Request]) -> RequestGroup:
        return RequestGroup("r", "p", [5, 6, 7], RequestOutputKind.DELTA,
                            [SequenceState(r, None, None) for r in seqs])

    for seqs in ([reqs[0]], reqs):
        wire, out = group(seqs).make_wire(), group(seqs).make_output()
        assert out is not None and wire == output_wire.encode(out)
        assert [c.index for c in out.outputs] == [r.index for r in seqs]
        assert out.outputs[0].token_ids == [9] and out.outputs[0].logprobs[0][9].logprob == -0.5
        assert out.metrics.first_token_time == 3.0
