"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's tokens are
appended, its pending input tokens read from N's results on the device. Everything it changes
must be invisible in the outputs: each case runs the same requests with overlapping steps and
without, and compares every token, text and finish reason; blocks must all come back.

On CPU the device work is synchronous, so nothing overlaps in time, but the bookkeeping is the
same code: pending tokens, inputs taken from the previous launch, wasted rows of requests that
the previous step ended, late aborts.
"""

from __future__ import annotations

import pytest

from engine.model_loader import load_tokenizer
from pdserve import LLM, SamplingParams

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived",
    "def fibonacci(n):",
    "Short",
    "A list of prime numbers: 2, 3, 5, 7,",
    "The quick brown fox jumps over the lazy dog. " * 4,
]


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    tok = load_tokenizer(tiny_llama_dir)
    return [tok.encode(t) for t in TEXTS]


def make(tiny_llama_dir: str, overlap: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 64 << 20)  # on a GPU: leave room for the other engines
    return LLM(tiny_llama_dir, dtype="float32", async_scheduling=overlap, **kwargs)


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
            for o in outs for c in o.outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.llm_engine.has_work()


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    return make(tiny_llama_dir, True), make(tiny_llama_dir, False)


def test_steps_overlap_and_greedy_tokens_match(pair, prompts):
    on, off = pair
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (1, 2, 7, 16, 24, 3)]
    engine = on.llm_engine
    launches = []
    launch = engine.runner.launch

    def spy(out):
        launches.append(engine._inflight is not None)  # a step still in flight at launch
        return launch(out)

    engine.runner.launch = spy
    try:
        assert outputs(on, prompts, params) == outputs(off, prompts, params)
    finally:
        engine.runner.launch = launch
    assert sum(launches) >= 20  # most launches happened with the previous step in flight
    assert_all_blocks_free(on)


def test_stops_mid_sequence_discard_the_overlapping_row(pair, prompts):
    """Stop tokens and stop strings end requests one step before the scheduler knows: the row
    already launched for them must not leak into the output."""
    on, off = pair
    free = outputs(off, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop_ids = sorted({tokens[5] for tokens, *_ in free})
    stop_text = next(text for _, text, *_ in free if len(text) > 12)[6:10]
    for params in (
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop_ids),
        SamplingParams(temperature=0, max_tokens=20, stop=[stop_text]),
    ):
        got, want = outputs(on, prompts, params), outputs(off, prompts, params)
        assert got == want
        assert any(reason == "stop" for _, _, reason, _ in got)
    assert_all_blocks_free(on)


def test_seeded_sampling_and_n_match(pair, prompts):
    on, off = pair
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=7, max_tokens=12,
                            ignore_eos=True)
    assert outputs(on, prompts, params) == outputs(off, prompts, params)
    assert_all_blocks_free(on)


def test_history_bound_requests_switch_overlap_off_and_still_match(pair, prompts):
    on, off = pair
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=8),
        SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.0, ignore_eos=True),
    ]
    assert outputs(on, prompts, params) == outputs(off, prompts, params)
    assert not on.llm_engine._history_bound
    assert_all_blocks_free(on)


def test_preemption_under_overlap_matches(tiny_llama_dir, prompts):
    """A KV cache too small for every sequence: requests are preempted while their token is
    pending and recomputed later, with that token."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = {"num_kv_blocks": 14, "max_model_len": 128}
    on, off = make(tiny_llama_dir, True, **small), make(tiny_llama_dir, False, **small)
    assert outputs(on, prompts, params) == outputs(off, prompts, params)
    assert on.llm_engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(on)


def test_abort_while_a_step_is_in_flight_frees_everything(pair, prompts):
    on, off = pair
    engine = on.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finished: dict[str, list[int]] = {}
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    assert engine.abort_request(["r1", "r4"])
    while engine.has_work():
        for o in engine.step():
            assert o.request_id not in ("r1", "r4")
            if o.finished:
                finished[o.request_id] = o.outputs[0].token_ids
    assert sorted(finished) == ["r0", "r2", "r3", "r5"]
    want = outputs(off, [prompts[i] for i in (0, 2, 3, 5)], params)
    assert [finished[k] for k in ("r0", "r2", "r3", "r5")] == [w[0] for w in want]
    assert_all_blocks_free(on)
