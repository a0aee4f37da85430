"""pdserve.bench.spec_decode_breakdown: every step of a run is filed by its kind and timed."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.bench.spec_decode import conversations
from pdserve.bench.spec_decode_breakdown import breakdown


def test_steps_are_filed_by_kind_and_cover_the_run(tiny_llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=512, kv_cache_memory=8 << 20,
              speculative_config=spec)
    convs = [[{"role": "user", "content": "a b c d a b c d a b c d a b c"}],
             *conversations("free", 1)[:1]]
    got = breakdown(llm, convs, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    steps = got["steps"]
    assert got["tokens"] == [12, 12]
    assert steps["prefill"]["count"] == 2  # one chunk per prompt
    assert set(steps) <= {"prefill"} | {f"q={q}" for q in range(5)}
    # every output token but the first (sampled by the prefill) came from a decode step
    decode_steps = sum(s["count"] for k, s in steps.items() if k.startswith("q="))
    assert 2 * 11 / 4 <= decode_steps <= 2 * 11
    assert 0 < got["decode_seconds"] < sum(s["seconds"] for s in steps.values())
    assert sum(s["seconds"] for s in steps.values()) <= got["seconds"]
