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
    back = output_wire.decode(output_wire.encode(_full(), prompt_ids=False))
    assert back.prompt_token_ids is None
    assert dataclasses.replace(back, prompt_token_ids=[5, 6, 7]) == _full()


def test_the_tuples_hold_every_dataclass_field() -> None:
    wire = output_wire.encode(_full())
    assert len(wire) == len(dataclasses.fields(RequestOutput))
    assert len(wire[3][0]) == len(dataclasses.fields(CompletionOutput))
    assert len(wire[5]) == len(dataclasses.fields(RequestMetrics))
