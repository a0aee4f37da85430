"""`RequestOutput` as plain tuples, for the engine core process's socket (engine/core_process.py).

NOTE: why. A step's outputs cross the socket every step. Pickled as dataclasses, every object
goes through `__reduce_ex__` (its class and a field dict); as tuples of the fields in order,
64 one-token outputs took 0.064 ms to encode and pickle against 0.145, 0.073 to unpickle and
rebuild against 0.144, in 6.9 KB against 11.3 (the CPU box). The engine core runs at one CPU at
saturation on a GPU host, so its per-step Python is its throughput.

The engine builds a step's outputs in this shape (`LLMEngine.step_wire`,
`RequestGroup.make_wire`): the engine core process sends them without making a dataclass, and
`decode` makes the `RequestOutput` everyone else gets.

A `Logprob` in a completion's or the prompt's logprobs crosses as itself (only requests that ask
for logprobs carry them). `tests/test_output_wire.py` holds the field lists equal to the
dataclasses', so a field added there fails until it is added here.
"""

from __future__ import annotations

from typing import Any

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

Wire = tuple[Any, ...]
REQUEST_ID, PROMPT_IDS, FINISHED = 0, 2, 4  # fields of a Wire read without decoding it


def without_prompt_ids(wire: Wire) -> Wire:
    """`wire` with its prompt's token ids left out (None): the reader has them already."""
    return (*wire[:PROMPT_IDS], None, *wire[PROMPT_IDS + 1:])


def encode(out: RequestOutput) -> Wire:
    """`out` as a tuple: `decode`'s inverse, the layout `RequestGroup.make_wire` builds
    directly (`without_prompt_ids` leaves the prompt's ids out)."""
    m = out.metrics
    return (out.request_id, out.prompt, out.prompt_token_ids,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs,
              c.cumulative_logprob) for c in out.outputs],
            out.finished,
            None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                    m.finished_time, m.num_cached_tokens, m.num_preemptions),
            out.num_cached_tokens, out.prompt_logprobs)


def decode(wire: Wire) -> RequestOutput:
    request_id, prompt, prompt_ids, outputs, finished, metrics, cached, prompt_logprobs = wire
    return RequestOutput(request_id, prompt, prompt_ids,
                         [CompletionOutput(*c) for c in outputs], finished,
                         None if metrics is None else RequestMetrics(*metrics), cached,
                         prompt_logprobs)
