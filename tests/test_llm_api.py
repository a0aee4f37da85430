"""The offline API's contract: sampling semantics, n > 1, stops, logprobs and bad input."""

from __future__ import annotations

import math

import pytest

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", seed=0)


PROMPTS = ["The quick brown fox", "Hello there, my friend", "Numbers: 1 2 3", "Why is the sky"]


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    alone = llm.generate(PROMPTS[2], seeded, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16)
    params = [unseeded, unseeded, seeded, unseeded]
    crowd = llm.generate(PROMPTS, params, use_tqdm=False)[2].outputs[0].token_ids
    reordered = llm.generate(PROMPTS[::-1], params[::-1], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == crowd == reordered
    other = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4321)
    assert llm.generate(PROMPTS[2], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(llm):
    greedy = ids(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), False))
    top1 = ids(llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=12),
                            False))
    assert greedy == top1


def test_n_completions_share_prompt_blocks(llm):
    prompt = "A long shared prompt " * 8
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (again,) = llm.generate(prompt, params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_min_tokens_and_ignore_eos(llm):
    eos = sorted(llm.llm_engine.eos_token_ids)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), False)[0]
    assert len(out.outputs[0].token_ids) <= 5
    forced = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[eos[0]], ignore_eos=True,
                            min_tokens=6)
    c = llm.generate(PROMPTS[0], forced, False)[0].outputs[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length"


def test_stop_string_is_cut_and_reported(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16), False)[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, stop=[stop]),
                       False)[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    keep = SamplingParams(temperature=0, max_tokens=16, stop=stop, include_stop_str_in_output=True)
    kept = llm.generate(PROMPTS[1], keep, False)[0].outputs[0].text
    assert kept == text[: text.index(stop)] + stop


def test_stop_token_ids_end_with_stop(llm):
    base = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10), False)[0]
    third = base.outputs[0].token_ids[2]
    c = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10,
                                                stop_token_ids=[third]), False)[0].outputs[0]
    assert c.token_ids[-1] == third and c.finish_reason == "stop" and c.stop_reason == third


def test_logprobs_are_the_chosen_and_top_k(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3)
    c = llm.generate(PROMPTS[0], params, False)[0].outputs[0]
    assert len(c.logprobs) == 4
    for tok, step in zip(c.token_ids, c.logprobs):
        assert tok in step and step[tok].rank == 1  # greedy picks the most likely
        assert len(step) == 3
        values = [lp.logprob for lp in step.values()]
        assert all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    assert c.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in
                                                     zip(c.token_ids, c.logprobs)))


def test_outputs_in_input_order_with_metrics(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3), use_tqdm=True)
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        assert o.finished and o.metrics.first_token_time >= o.metrics.arrival_time
        assert o.metrics.finished_time >= o.metrics.first_token_time


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(max_tokens="7"), "max_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_nothing_queued(llm):
    engine = llm.llm_engine
    too_long = list(range(5, 5 + engine.max_model_len))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", {"prompt_token_ids": too_long}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate("still works", SamplingParams(max_tokens=2), use_tqdm=False)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="model"):
        LLM("some-org/not-downloaded")


def test_bad_engine_arguments(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama_dir, max_model_len=10**6)
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_llama_dir, block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_llama_dir, dtype="float8")
