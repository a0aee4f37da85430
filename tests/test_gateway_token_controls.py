"""OpenAI's logit_bias and vLLM's allowed_token_ids and bad_words on the colocated gateway
(in-process app, real engine on the bundled model, the official `openai` client): they steer
the tokens as the engine's own tests show, and a token id outside the vocabulary, a bias out of
range or an empty list is a 400 naming the field. tests/test_cluster.py sends them through the
workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from gateway.app import build_app
from gateway.local_backend import LocalBackend

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def http(bundled_async_engine: AsyncLLMEngine) -> Iterator[httpx.Client]:
    with TestClient(build_app(LocalBackend(bundled_async_engine, "smol"))) as client:
        yield client


@pytest.fixture(scope="module")
def client(http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)


def _ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, bundled_tokenizer: Any):
    (yes,) = _ids(bundled_tokenizer, " yes")
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(yes): 100})
    assert r.choices[0].text == " yes" * 4
    plain = client.chat.completions.create(model="smol", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": PROMPT}])
    first = _ids(bundled_tokenizer, plain.choices[0].message.content or "")[0]
    banned = client.chat.completions.create(
        model="smol", max_tokens=6, temperature=0, logit_bias={str(first): -100},
        messages=[{"role": "user", "content": PROMPT}], logprobs=True)
    assert banned.choices[0].logprobs is not None
    assert banned.choices[0].logprobs.content[0].token != bundled_tokenizer.decode([first])


def test_allowed_token_ids_and_bad_words(client: openai.OpenAI, bundled_tokenizer: Any):
    allowed = _ids(bundled_tokenizer, " Paris London")
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"allowed_token_ids": allowed})
    assert set(_ids(bundled_tokenizer, r.choices[0].text)) <= set(allowed)
    plain = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    word = plain.choices[0].text.split()[0]
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"bad_words": [" " + word]})
    assert not r.choices[0].text.startswith(" " + word)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"logit_bias": {"99999999": 5}}, "logit_bias", "logit_bias holds token id 99999999, out"),
    ({"logit_bias": {"12": 101}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias"),
    ({"allowed_token_ids": [49152]}, "allowed_token_ids", "allowed_token_ids holds token id"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids must be a non-empty"),
    ({"bad_words": [""]}, "bad_words", "bad_words must be a list of non-empty strings"),
])
def test_bad_token_controls_are_400s_naming_the_field(http: httpx.Client, body: dict,
                                                      param: str, message: str) -> None:
    r = http.post("/v1/completions", json={"model": "smol", "prompt": PROMPT, "max_tokens": 2,
                                           **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error
