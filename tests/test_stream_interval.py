"""`stream_interval`: a streamed request's outputs leave the engine with its first token, then once
every `stream_interval` tokens, and when it finishes; together they carry exactly what interval 1
carries (tokens, text, logprobs), and a request served through `pdserve serve --stream-interval`
streams the same text to the official `openai` client in fewer chunks."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from engine.output_processor import RequestGroup, SequenceState
from engine.request import Request
from engine.sampling_params import RequestOutputKind
from pdserve import AsyncLLMEngine, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because"


def _outputs(engine: LLMEngine, params: SamplingParams, prompt: str = PROMPT) -> list:
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


def _joined(outs: list, field: str) -> list | str:
    parts = [getattr(o.outputs[0], field) for o in outs]
    return "".join(parts) if field == "text" else [x for part in parts for x in part]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """(interval 1, interval 3) engines on the same tiny model."""
    return tuple(LLMEngine(build_engine_config(tiny_llama_dir, dtype="float32",
                                               kv_cache_memory=8 << 20, stream_interval=k))
                 for k in (1, 3))


def test_deltas_every_interval_tokens_carry_the_same_tokens_text_and_logprobs(engines):
    every, third = engines
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
    one, three = _outputs(every, params), _outputs(third, params)
    assert [len(o.outputs[0].token_ids) for o in one] == [1] * 11
    # the first token at once, then every 3 tokens, the last with the finish: 1 + 3 + 3 + 3 + 1
    assert [len(o.outputs[0].token_ids) for o in three] == [1, 3, 3, 3, 1]
    assert [o.finished for o in three] == [False] * 4 + [True]
    for field in ("token_ids", "text", "logprobs"):
        assert _joined(one, field) == _joined(three, field), field
    assert three[-1].outputs[0].finish_reason == "length"


def test_cumulative_outputs_and_n_sequences_follow_the_longest(engines):
    _, third = engines
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    assert [len(o.outputs[0].token_ids) for o in _outputs(third, params)] == [1, 4, 7]
    params = SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=5, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    outs = _outputs(third, params)
    assert [max(len(c.token_ids) for c in o.outputs) for o in outs] == [1, 3, 1]
    assert all(sum(len(o.outputs[i].token_ids) for o in outs) == 5 for i in range(2))


def test_a_stop_string_between_intervals_finishes_at_once(engines):
    every, third = engines
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = _outputs(every, greedy)[-1].outputs[0].text
    stop = text[len(text) // 2:][:3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                            output_kind=RequestOutputKind.DELTA)
    outs = _outputs(third, params)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert "".join(o.outputs[0].text for o in outs) == text[:text.index(stop)]


def test_tokens_without_text_do_not_count_as_the_first_output():
    """A first token whose text is held back (a partial character) or empty (a special token)
    must not start the interval, else the first visible text would wait `stream_interval`
    tokens."""
    req = Request("r", [1, 2], SamplingParams(max_tokens=20), max_tokens=20)
    seq = SequenceState(req, detok=object(), matcher=None)  # absorb() is not called here
    group = RequestGroup("r", None, [1, 2], RequestOutputKind.DELTA, seqs=[seq],
                         stream_interval=4)
    sent = []
    for step, text in enumerate(["", "", "a", "b", "c", "d", "e", "f", "g"]):
        req.output_token_ids.append(100 + step)
        seq.text += text
        out = group.make_output()
        if out is not None:
            sent.append((out.outputs[0].token_ids, out.outputs[0].text))
    assert sent == [([100], ""), ([101], ""), ([102], "a"), ([103, 104, 105, 106], "bcde")]


def test_a_bad_interval_is_a_value_error_naming_it(tiny_llama_dir):
    with pytest.raises(ValueError, match="stream_interval"):
        build_engine_config(tiny_llama_dir, stream_interval=0)


def test_the_async_engine_streams_every_interval(tiny_llama_dir):
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20,
                                      stream_interval=4)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def main() -> list[int]:
        async with aclosing(engine.generate(PROMPT, params, "a")) as outs:
            return [len(o.outputs[0].token_ids) async for o in outs]

    try:
        assert asyncio.run(main()) == [1, 4, 4]
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_split_cluster_streams_the_same_text_in_fewer_chunks(tiny_llama_dir, tmp_path):
    """`pdserve up --stream-interval 4`: the decode worker's tokens reach the official client
    four at a time (its first ones at once), the same text as the colocated engine's."""
    import openai
    from cluster import run_cluster

    from engine.llm import LLM

    prompt = [1, 17, 230, 58, 901, 44, 12, 7]
    greedy = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    want = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20).generate(
        [{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0]
    with run_cluster(tmp_path, "--model", tiny_llama_dir, "--dtype", "float32",
                     "--stream-interval", "4") as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="-", max_retries=0)
        model = client.models.list().data[0].id
        chunks = [ch.choices[0].text for ch in client.completions.create(
            model=model, prompt=prompt, max_tokens=17, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].text]
    assert "".join(chunks) == want.text
    # prefill's token, then the decode worker's: 16 tokens as 1 + 4 + 4 + 4 + 3 at most
    assert len(chunks) <= 6 < len(want.token_ids)
