"""vLLM's /tokenize, /detokenize and /version on the colocated gateway (in-process app, real
engine on the bundled model): ids as generation sees them (the usage the official `openai`
client reads back), text round trips, and the 400s naming the field. These are not OpenAI
routes: they are driven with the httpx client under the `openai` one.
tests/test_cluster.py runs them through the tokenizer service."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import pdserve
from engine.async_engine import AsyncLLMEngine
from gateway.app import build_app
from gateway.local_backend import LocalBackend

PROMPT = "The capital of France is"
CHAT: Any = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is the capital of France?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def engine(bundled_async_engine: AsyncLLMEngine) -> AsyncLLMEngine:
    return bundled_async_engine


@pytest.fixture(scope="module")
def http(engine: AsyncLLMEngine) -> Iterator[httpx.Client]:
    with TestClient(build_app(LocalBackend(engine, "smol"))) as client:
        yield client


@pytest.fixture(scope="module")
def client(http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)


def error_of(r: httpx.Response, status: int = 400) -> tuple[str, str | None]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    return error["message"], error["param"]


def test_a_prompt_tokenizes_as_completions_count_it(http: httpx.Client, client: openai.OpenAI,
                                                    bundled_tokenizer: Any) -> None:
    r = http.post("/tokenize", json={"model": "smol", "prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": len(body["tokens"]), "max_model_len": 2048,
                    "tokens": bundled_tokenizer.encode(PROMPT), "token_strs": None}
    usage = client.completions.create(model="smol", prompt=PROMPT, max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == body["count"]
    strs = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert strs["tokens"] == body["tokens"]
    assert strs["token_strs"] == bundled_tokenizer.convert_ids_to_tokens(body["tokens"])
    assert "".join(strs["token_strs"]) == "The\u0120capital\u0120of\u0120France\u0120is"


def test_a_conversation_tokenizes_as_chat_completions_count_it(
        http: httpx.Client, client: openai.OpenAI, bundled_tokenizer: Any) -> None:
    body = http.post("/tokenize", json={"messages": CHAT}).json()
    assert body["tokens"] == bundled_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    usage = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == body["count"]
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert body["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < body["count"]
    # SmolLM2's tokenizer adds no special tokens of its own: the text encodes to the same ids
    special = http.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()
    assert special["tokens"] == body["tokens"]
    with_tools = http.post("/tokenize", json={"messages": CHAT, "tools": [TOOL]}).json()
    assert "get_weather" in bundled_tokenizer.decode(with_tools["tokens"])


def test_detokenize_returns_the_text_special_tokens_included(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    text = http.post("/detokenize", json={"model": "smol", "tokens": chat}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_version(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": pdserve.__version__}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": CHAT, "prompt": "x"}, "prompt"),  # one shape or the other
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{x}}"},
     "chat_template"),  # not started with --trust-request-chat-template
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "x"}]},
     "tools"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, path: str, body: Any,
                                             param: str) -> None:
    assert error_of(http.post(path, json=body))[1] == param


def test_out_of_vocabulary_message_and_unknown_model(http: httpx.Client) -> None:
    message, _ = error_of(http.post("/detokenize", json={"tokens": [1, 49152]}))
    assert message == "Token id 49152 is out of vocabulary (size 49152)."
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = http.post(path, json={**body, "model": "gpt-4"})
        assert error_of(r, 404) == ("The model `gpt-4` does not exist.", "model")
