"""logit_bias, allowed_token_ids and bad_words (engine/token_controls.py): exact effects on a
step's logits, through the sampler in every mode, and on the bundled model's outputs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.token_controls import apply_token_controls, bad_words_token_ids
from pdserve import LLM


def _row(output=(), bad=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [1], list(output), frozenset({2}),
                       bad_words_token_ids=[list(b) for b in bad])


def test_controls_edit_exactly_their_rows_and_tokens():
    logits = torch.zeros(4, 10)
    rows = [_row(logit_bias={3: 5.0, "4": -100}), _row(allowed_token_ids=[7, 8]),
            _row(output=[5, 6], bad=[[6, 9], [5, 8], [1]]), _row()]
    out = apply_token_controls(logits, rows)
    assert out[0].tolist() == [0, 0, 0, 5, -100, 0, 0, 0, 0, 0]
    assert torch.isinf(out[1]).tolist() == [True] * 7 + [False, False, True]
    # [6, 9]: the output ends with 6, so 9 is banned; [5, 8] does not match; [1] always
    assert [i for i, v in enumerate(out[2].tolist()) if v == -math.inf] == [1, 9]
    assert out[3].tolist() == [0.0] * 10 and logits.abs().sum() == 0  # input untouched


@pytest.mark.parametrize("mode", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.9),
                                  dict(temperature=1.0, top_k=3, seed=1)])
def test_sampler_respects_allowed_ids_and_a_forcing_bias(mode):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 100, generator=gen)
    rows = [_row(allowed_token_ids=[10, 20, 30], **mode) for _ in range(16)] + [
        _row(logit_bias={42: 100.0}, **mode) for _ in range(16)]
    for r in rows:
        if r.params.seed is not None:
            r.generator = torch.Generator().manual_seed(r.params.seed)
    tokens = Sampler()(logits, rows, torch.Generator().manual_seed(1)).token_ids
    assert all(t in (10, 20, 30) for t in tokens[:16]) and tokens[16:] == [42] * 16


def test_bad_values_are_value_errors():
    with pytest.raises(ValueError, match="logit_bias values must be in"):
        SamplingParams(logit_bias={1: 200})
    with pytest.raises(ValueError, match="logit_bias must be an integer"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        SamplingParams(bad_words=[""])


def test_on_the_bundled_model(bundled_path):
    llm = LLM(bundled_path, device="cpu", max_model_len=512, kv_cache_memory=32 << 20)
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=8)
    (plain,) = llm.generate([prompt], greedy, use_tqdm=False)
    assert "Paris" in plain.outputs[0].text
    (banned,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                      bad_words=["Paris"]), use_tqdm=False)
    assert "Paris" not in banned.outputs[0].text
    seqs = bad_words_token_ids(tok, ["Paris"])
    out = banned.outputs[0].token_ids
    assert not any(out[i:i + len(s)] == s for s in seqs for i in range(len(out)))
    allowed = tok.encode(" yes no", add_special_tokens=False)
    (only,) = llm.generate([prompt], SamplingParams(temperature=0.9, max_tokens=6,
                                                    allowed_token_ids=allowed), use_tqdm=False)
    assert set(only.outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="token ids in"):
        llm.generate([prompt], SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)
