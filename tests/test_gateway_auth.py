"""`--api-key` (or PDSERVE_API_KEY): every /v1 route, /tokenize, /detokenize and /workers answer
401 in OpenAI's shape without the bearer key, before reading the body; /health, /ready, /metrics
and /version stay open for probes and scrapers, as with vLLM's option."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from gateway.app import build_app
from gateway.server import add_arguments, add_colocated_arguments

KEY = "sesame"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(bundled_tokenizer: Any) -> Iterator[TestClient]:
    app = build_app(FakeBackend(bundled_tokenizer), api_key=KEY, max_body_bytes=1024)
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY}, {"Authorization": "Bearer"}, {"X-Api-Key": KEY},
])
def test_without_the_key_every_api_route_is_401(http: TestClient, headers: dict) -> None:
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {"prompt": "x"}),
        ("GET", "/v1/models", None), ("GET", "/workers", None),
        ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
    ]:
        r = http.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (path, headers)
        assert r.json()["error"]["code"] == "invalid_api_key"
    oversized = http.post("/v1/completions", content=b"x" * 4096, headers=headers)
    assert oversized.status_code == 401  # the key is checked before the body is read


def test_with_the_key_and_open_ops_routes(http: TestClient) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    r = http.post("/v1/chat/completions", json=CHAT, headers=auth)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert http.get("/v1/models", headers={"Authorization": f"bearer  {KEY}"}).status_code == 200
    assert http.post("/tokenize", json={"prompt": "Hi"}, headers=auth).json()["count"] >= 1
    assert http.post("/detokenize", json={"tokens": [1]}, headers=auth).status_code == 200
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert http.get(path).status_code == 200, path


@pytest.mark.parametrize("add", [add_arguments, add_colocated_arguments])
def test_api_key_reads_its_environment(add: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    parser = argparse.ArgumentParser()
    add(parser)
    assert parser.parse_args([]).api_key == KEY
    assert parser.parse_args(["--api-key", "other"]).api_key == "other"
