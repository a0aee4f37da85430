"""pdserve bench cpu-gguf: the ratios against llama.cpp and the variant checks (no engine run)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench import cpu_gguf


def _round(ms: float, tok_s: float, rss: float, first: list[int]) -> dict:
    return {"load_s": 1.0, "rss_mib": rss, "weights_mib": 90.0, "ms_per_token": ms,
            "batch_tok_s": tok_s, "first_tokens": first}


def test_ratios_against_llamacpp() -> None:
    rounds = {"gguf": [_round(20.0, 150.0, 800.0, [1, 2, 3, 9])],
              "llamacpp": [_round(10.0, 100.0, 200.0, [1, 2, 3, 4])]}
    medians = {v: {k: r[0][k] for k in cpu_gguf.METRICS} for v, r in rounds.items()}
    ratios = cpu_gguf._against_peer(rounds, medians)
    assert ratios == {"gguf": {"single_stream_speed": 0.5, "batched_speed": 1.5, "rss": 4.0,
                               "first_tokens_equal": 3}}


def test_unknown_variant_is_refused() -> None:
    parser = argparse.ArgumentParser()
    cpu_gguf.add_arguments(parser)
    args = parser.parse_args(["--variants", "gguf,llama"])
    with pytest.raises(ValueError, match="unknown \\['llama'\\]"):
        cpu_gguf.run(args)
