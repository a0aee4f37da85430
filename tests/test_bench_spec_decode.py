"""pdserve.bench.spec_decode's measure: both engines run the same requests, alternating their
order by round, and a speculating engine's row lists its timed decode steps by query-token
count with its planner's estimates."""

from __future__ import annotations

import argparse

from pdserve import LLM
from pdserve.bench.spec_decode import measure


def test_rows_carry_the_speculating_engines_steps(tiny_llama_dir):
    common = dict(device="cpu", max_model_len=512, kv_cache_memory=8 << 20)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    engines = {"off": LLM(tiny_llama_dir, **common),
               "ngram k=3": LLM(tiny_llama_dir, speculative_config=spec, **common)}
    args = argparse.Namespace(tokens=10, rounds=2, lengths="plain")
    off, ngram = measure(engines, "copy", 2, args)
    assert (off.config, ngram.config) == ("off", "ngram k=3")
    assert off.tokens == ngram.tokens > 0 and off.steps is None
    # every decode step of both timed rounds is filed, each size with the plan's estimate
    assert sum(s["steps"] for s in ngram.steps.values()) >= ngram.tokens / 4 / 2
    assert all(s["mean_ms"] > 0 and s["planned_ms"] > 0 for s in ngram.steps.values())
    assert "measured" not in vars(engines["ngram k=3"].llm_engine.planner)  # unwatched again
