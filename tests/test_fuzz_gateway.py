"""Fuzz the gateway through its own OpenAPI spec (schemathesis, in-process ASGI, fake backend):
requests that fit the spec and requests that do not (negative mode) never get a 5xx, every
answer is a status the spec declares with the body it declares, and afterwards the gateway
serves a normal request. Bounded: a fixed seed and a few dozen examples per route.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.app import build_app

MODEL = "fake"
CHECKS = [
    not_a_server_error, status_code_conformance, content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def app(bundled_tokenizer: Any) -> Any:
    backend = FakeBackend(bundled_tokenizer, MODEL, max_model_len=64)
    return build_app(backend, max_body_bytes=64 << 10, trust_request_chat_template=True)


@pytest.fixture(scope="module")
def api_schema(app: Any) -> Any:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], database="none",
    )
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx(case: Any) -> None:
    model = case.body.get("model") if isinstance(case.body, dict) else None
    if isinstance(model, str) and len(model) % 4:
        case.body["model"] = MODEL  # random names are 404s: most requests get further in
    case.call_and_validate(checks=CHECKS)


def test_the_spec_declares_bodies_and_errors(app: Any) -> None:
    spec = TestClient(app).get("/openapi.json").json()
    route = spec["paths"]["/v1/chat/completions"]["post"]
    body = route["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"400", "401", "404", "413", "429", "503"} <= set(route["responses"])
    error = route["responses"]["413"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage"} <= set(
        spec["components"]["schemas"])


def test_serves_normally_after_the_fuzz(app: Any) -> None:
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        streamed = http.post("/v1/completions", content=json.dumps(
            {"prompt": "Hello", "max_tokens": 2, "stream": True}))
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
