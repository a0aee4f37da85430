"""Every malformed or out-of-range request gets a 4xx in OpenAI's error shape naming the
parameter, and the gateway keeps serving. In-process (ASGI) over a fake backend: no engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from gateway.app import build_app

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
LIMIT = 16384  # --max-body-bytes of the app under test


@pytest.fixture(scope="module")
def backend(bundled_tokenizer: Any) -> FakeBackend:
    return FakeBackend(bundled_tokenizer, "fake", max_model_len=128)


@pytest.fixture(scope="module")
def http(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(build_app(backend, max_body_bytes=LIMIT)) as client:
        yield client


def error_of(r: Any) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ("invalid_request_error" if r.status_code < 500 else
                                     "server_error")
    return body["error"]


def post_raw(http: TestClient, path: str, raw: bytes) -> Any:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


# (path, raw body) -> (status, param, code); `None` where OpenAI names no parameter.
RAW_CASES = {
    "bad JSON": (CMPL, b"{not json", 400, None, None),
    "invalid UTF-8": (CMPL, b'{"prompt": "caf\xe9"}', 400, None, "invalid_encoding"),
    "UTF-16 body": (CMPL, '{"prompt": "hi"}'.encode("utf-16"), 400, None, "invalid_encoding"),
    "lone surrogate": (CMPL, b'{"prompt": "\\ud800"}', 400, None, "invalid_encoding"),
    "surrogate in model name": (CMPL, b'{"prompt": "a", "model": "\\udfff"}', 400, None,
                                "invalid_encoding"),
    "NaN": (CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, None, None),
    "Infinity": (CMPL, b'{"prompt": "hi", "top_p": -Infinity}', 400, None, None),
    "nested too deeply": (CMPL, b"[" * 3000 + b"]" * 3000, 400, None, None),
    "over-long integer": (CMPL, b'{"prompt": "hi", "n": ' + b"9" * 4400 + b"}", 400, None,
                          None),
    "number that overflows to inf": (CMPL, b'{"prompt": "hi", "temperature": 1e400}', 400,
                                     "temperature", None),
    "not an object": (CHAT, b"[1, 2]", 400, None, None),
    "empty body": (CHAT, b"", 400, None, None),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_malformed_bodies(http: TestClient, case: str) -> None:
    path, raw, status, param, code = RAW_CASES[case]
    r = post_raw(http, path, raw)
    assert r.status_code == status, r.text
    error = error_of(r)
    assert (error["param"], error["code"]) == (param, code), error
    if case == "an image content part":  # a sentence, not pydantic's union dump
        assert "'image_url' are not supported" in error["message"], error
        assert "union" not in error["message"].lower()


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": "Hello", "max_tokens": 4, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": HI, "max_tokens": 4, **kw}


# (path, body) -> (status, param, code)
JSON_CASES = {
    "n not an integer": (CMPL, cmpl(n="x"), 400, "n", None),
    "prompt a number": (CMPL, cmpl(prompt=5), 400, "prompt", None),
    "prompt mixed list": (CMPL, cmpl(prompt=["a", 1]), 400, "prompt", None),
    "messages a string": (CHAT, chat(messages="hi"), 400, "messages", None),
    "message without role": (CHAT, chat(messages=[{"content": "x"}]), 400, "messages", None),
    "image content part": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages", None),
    "stream not a bool": (CMPL, cmpl(stream="maybe"), 400, "stream", None),
    "temperature a word": (CMPL, cmpl(temperature="hot"), 400, "temperature", None),
    "max_tokens fractional": (CMPL, cmpl(max_tokens=1.5), 400, "max_tokens", None),
    "stop a number": (CMPL, cmpl(stop=5), 400, "stop", None),
    "stop_token_ids strings": (CMPL, cmpl(stop_token_ids=["a"]), 400, "stop_token_ids", None),
    "missing prompt": (CMPL, {"model": "fake"}, 400, "prompt", None),
    "missing messages": (CHAT, {"model": "fake"}, 400, "messages", None),
    "empty prompt": (CMPL, cmpl(prompt=""), 400, "prompt", None),
    "empty prompt list": (CMPL, cmpl(prompt=[]), 400, "prompt", None),
    "empty prompt in a batch": (CMPL, cmpl(prompt=["a", ""]), 400, "prompt", None),
    "empty token prompt in a batch": (CMPL, cmpl(prompt=[[1], []]), 400, "prompt", None),
    "empty messages": (CHAT, chat(messages=[]), 400, "messages", None),
    "unknown model": (CMPL, cmpl(model="gpt-4"), 404, "model", "model_not_found"),
    "n too large": (CMPL, cmpl(n=129), 400, "n", None),
    "n zero": (CHAT, chat(n=0), 400, "n", None),
    "max_tokens beyond the context": (CMPL, cmpl(max_tokens=500), 400, "prompt",
                                      "context_length_exceeded"),
    "max_tokens beyond uint32": (CMPL, cmpl(max_tokens=2**32), 400, "max_tokens", None),
    "max_completion_tokens beyond the context": (
        CHAT, chat(max_tokens=None, max_completion_tokens=500), 400, "messages",
        "context_length_exceeded"),
    "max_tokens zero": (CMPL, cmpl(max_tokens=0), 400, "max_tokens", None),
    "prompt over the context": (CMPL, cmpl(prompt=[5] * 200), 400, "prompt",
                                "context_length_exceeded"),
    "chat over the context": (CHAT, chat(messages=[{"role": "user", "content": "word " * 200}]),
                              400, "messages", "context_length_exceeded"),
    "token id outside the vocabulary": (CMPL, cmpl(prompt=[10**9]), 400, "prompt", None),
    "negative token id": (CMPL, cmpl(prompt=[-1]), 400, "prompt", None),
    "too many stop strings": (CMPL, cmpl(stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    "empty stop string": (CMPL, cmpl(stop=[""]), 400, "stop", None),
    "too many stop token ids": (CMPL, cmpl(stop_token_ids=list(range(17))), 400,
                                "stop_token_ids", None),
    "stop token id beyond uint32": (CMPL, cmpl(stop_token_ids=[2**32]), 400, "stop_token_ids",
                                    None),
    "too many prompts": (CMPL, cmpl(prompt=[[1]] * 2049), 400, "prompt", None),
    "seed beyond int64": (CMPL, cmpl(seed=2**63), 400, "seed", None),
    "seed + n beyond int64": (CMPL, cmpl(seed=2**63 - 1, n=2), 400, "seed", None),
    "top_k beyond uint32": (CMPL, cmpl(top_k=2**32), 400, "top_k", None),
    "negative temperature": (CMPL, cmpl(temperature=-1), 400, "temperature", None),
    "temperature beyond float32": (CMPL, cmpl(temperature=1e300), 400, "temperature", None),
    "repetition_penalty that float32 makes 0": (CHAT, chat(repetition_penalty=1e-300), 400,
                                                "repetition_penalty", None),
    "top_p that float32 makes 0": (CMPL, cmpl(top_p=1e-45), 400, "top_p", None),
    "top_p zero": (CMPL, cmpl(top_p=0), 400, "top_p", None),
    "presence_penalty out of range": (CMPL, cmpl(presence_penalty=3), 400, "presence_penalty",
                                      None),
    "logprobs over 20": (CMPL, cmpl(logprobs=21), 400, "logprobs", None),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    "min_tokens over max_tokens": (CMPL, cmpl(min_tokens=9), 400, "min_tokens", None),
    "stream_options without stream": (CMPL, cmpl(stream_options={"include_usage": True}), 400,
                                      "stream_options", None),
    "suffix": (CMPL, cmpl(suffix="x"), 400, "suffix", None),
    "chat template from the request": (CHAT, chat(chat_template="{{ 1 }}"), 400,
                                       "chat_template", None),
    "an image content part": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400,
        "messages", None),
    # tool calling (tests/test_gateway_tools.py serves it)
    "tool without a function": (CHAT, chat(tools=[{"type": "function"}]), 400, "tools", None),
    "tools on completions": (CMPL, cmpl(tools=[{"type": "function", "function": {"name": "f"}}]),
                             400, "tools", None),
    "tools without auto tool choice enabled": (
        CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice",
        None),
    "tool_choice required without tools": (CHAT, chat(tool_choice="required"), 400,
                                           "tool_choice", None),
    "parallel_tool_calls not a bool": (CHAT, chat(parallel_tool_calls="x"), 400,
                                       "parallel_tool_calls", None),
    # OpenAI fields pdserve cannot honour: refused rather than silently ignored
    "functions": (CHAT, chat(functions=[{"name": "f", "parameters": {}}]), 400, "functions",
                  None),
    "function_call": (CHAT, chat(function_call={"name": "f"}), 400, "function_call", None),
    "logit_bias out of range": (CMPL, cmpl(logit_bias={"5": 1000}), 400, "logit_bias", None),
}


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_bad_requests_name_their_parameter(http: TestClient, case: str) -> None:
    path, body, status, param, code = JSON_CASES[case]
    r = post_raw(http, path, json.dumps(body).encode())
    assert r.status_code == status, r.text
    error = error_of(r)
    assert (error["param"], error["code"]) == (param, code), error


def test_a_trusted_request_chat_template_runs_and_may_fail(backend: FakeBackend) -> None:
    with TestClient(build_app(backend, trust_request_chat_template=True)) as trusting:
        ok = trusting.post(CHAT, json=chat(chat_template="{{ messages[0]['content'] }}"))
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 1
        for broken in ("{% if %}", "{{ 1 / 0 }}", "{{ messages.__class__.__mro__ }}"):
            r = trusting.post(CHAT, json=chat(chat_template=broken))
            assert r.status_code == 400 and error_of(r)["param"] == "messages", broken


def test_context_length_message_is_openais(http: TestClient) -> None:
    r = http.post(CMPL, json=cmpl(prompt=[5] * 200))
    assert error_of(r)["message"] == (
        "This model's maximum context length is 128 tokens. However, you requested 204 tokens "
        "(200 in the messages, 4 in the completion). Please reduce the length of the messages "
        "or completion."
    )


def test_oversized_bodies_get_413_declared_or_not(http: TestClient) -> None:
    big = json.dumps(cmpl(prompt="x" * LIMIT)).encode()
    declared = post_raw(http, CMPL, big)
    assert declared.status_code == 413 and error_of(declared)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield big[:LIMIT // 2]
        yield big[LIMIT // 2:]

    streamed = http.post(CMPL, content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    just_fits = json.dumps(cmpl(prompt="x" * (LIMIT - 100))).encode()
    assert len(just_fits) <= LIMIT and post_raw(http, CMPL, just_fits).status_code != 413


def test_unknown_fields_asking_for_something_are_refused_by_name(http: TestClient) -> None:
    """Never dropped silently: a field the gateway does not know is a 400 naming it, unless
    its value asks for nothing (then the request is served)."""
    for body, param in ((cmpl(frobnicate=True), "frobnicate"), (cmpl(best_of=2), "best_of"),
                        (chat(store=True), "store"), (chat(service_tier="flex"), "service_tier"),
                        (chat(frobnicate=0), "frobnicate")):
        r = http.post(CHAT if "messages" in body else CMPL, json=body)
        assert r.status_code == 400, r.text
        assert error_of(r)["param"] == param
        assert error_of(r)["message"] == f"{param} is not supported: pdserve does not " \
                                         "implement this field."
    quiet = cmpl(best_of=1, frobnicate=None, extra=[], service_tier="auto",
                 metadata={"team": "a"})
    r = http.post(CMPL, json=quiet)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_unsupported_fields_that_ask_for_nothing_are_accepted(http: TestClient) -> None:
    """What OpenAI clients send by default, or send empty: served, not refused."""
    quiet = {"user": "u1", "store": False, "metadata": {}, "service_tier": None, "tools": [],
             "tool_choice": "none", "functions": [], "function_call": "none",
             "parallel_tool_calls": None}
    for path, body in ((CHAT, chat(**quiet)), (CMPL, cmpl(**quiet))):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text


def test_wrong_method_and_path(http: TestClient) -> None:
    assert http.get(CMPL).status_code == 405 and error_of(http.get(CMPL))["message"]
    assert http.post("/v1/nothing", json={}).status_code == 404


def test_still_serves_after_bad_input(http: TestClient, backend: FakeBackend) -> None:
    for case in list(RAW_CASES.values())[:3]:
        post_raw(http, case[0], case[1])
    before = backend.generated
    r = http.post(CMPL, json=cmpl(n=2, logprobs=1, seed=2**63 - 129))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert r.json()["usage"]["completion_tokens"] == 6
    streamed = http.post(CHAT, json=chat(stream=True))
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert backend.generated == before + 3
