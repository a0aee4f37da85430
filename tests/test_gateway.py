"""The OpenAI gateway over a real HTTP server (uvicorn) and the in-process engine, driven by the
official `openai` client: responses equal the offline `LLM`, stop strings, logprobs, usage,
errors in OpenAI's shape, metrics, the state store, and aborts when the client goes away."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from gateway.app import build_app
from gateway.backend import BackendError
from gateway.local_backend import LocalBackend
from pdserve import LLM, SamplingParams
from pdserve.ports import free_port

PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "user", "content": "Tell me a story about a dragon."}]
MAX_MODEL_LEN = 512


class RecordingStore:
    """The state store's two methods, recorded in memory."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, dict[str, Any]]]] = {}

    async def create(
        self, request_id: str, *, model: str, prompt_tokens: int, stream: bool, n: int = 1
    ) -> None:
        fields = {"model": model, "prompt_tokens": prompt_tokens, "stream": stream, "n": n}
        self.records[request_id] = [("queued", fields)]

    async def transition(self, request_id: str, status: str, **fields: Any) -> None:
        self.records[request_id].append((status, fields))

    def final(self, request_id: str | None = None, timeout_s: float = 5.0) -> tuple[str, dict]:
        """The last status of a request (default: the latest created), once it has ended."""
        deadline = time.monotonic() + timeout_s
        while True:
            key = request_id if request_id is not None else list(self.records)[-1]
            if len(self.records[key]) > 1:
                return self.records[key][-1]
            assert time.monotonic() < deadline, f"{key} never ended: {self.records[key]}"
            time.sleep(0.02)


class Server:
    """uvicorn serving `app` on a free loopback port, in a background thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=16 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def store() -> RecordingStore:
    return RecordingStore()


@pytest.fixture(scope="module")
def base_url(engine: AsyncLLMEngine, store: RecordingStore) -> Iterator[str]:
    with Server(build_app(LocalBackend(engine, "tiny"), store=store)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)


def greedy(max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0, "max_tokens": max_tokens, **kw}


def engine_stats(engine: AsyncLLMEngine) -> Any:
    return asyncio.run(engine.stats())


def wait_until_idle(engine: AsyncLLMEngine, timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(engine)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.05)


# ---- completions -------------------------------------------------------------------------
def test_completion_greedy_equals_offline_llm(client: openai.OpenAI, llm: LLM) -> None:
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = client.completions.create(prompt=PROMPT, **greedy(12))
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    (choice,) = r.choices
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids) == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_with_usage_chunk(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt=PROMPT, **greedy(10)).choices[0].text
    chunks = list(client.completions.create(
        prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **greedy(10)
    ))
    *pieces, usage = chunks
    assert "".join(c.choices[0].text for c in pieces) == whole
    assert pieces[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in pieces)
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + 10


def test_token_id_prompts_and_batches(client: openai.OpenAI, llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    ids, hello = tokenizer.encode(PROMPT), tokenizer.encode("Hello")
    by_text = client.completions.create(prompt=[PROMPT, "Hello"], **greedy(6))
    r = client.completions.create(prompt=[ids, hello], n=2, **greedy(6))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [by_text.choices[i].text for i in (0, 0, 1, 1)]
    assert r.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids) + len(hello)
    assert r.usage.completion_tokens == 4 * 6


def test_n_and_seed_equal_offline_llm(client: openai.OpenAI, llm: LLM) -> None:
    kw = {"model": "tiny", "temperature": 1.0, "max_tokens": 8, "seed": 7, "n": 2}
    first = client.completions.create(prompt=PROMPT, **kw)
    again = client.completions.create(prompt=PROMPT, **kw)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and texts[0] != texts[1]
    ref = llm.generate(
        PROMPT, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=7), use_tqdm=False
    )[0]
    assert texts == [c.text for c in ref.outputs]
    other = client.completions.create(prompt=PROMPT, **{**kw, "seed": 8})
    assert [c.text for c in other.choices] != texts


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(prompt=PROMPT, logprobs=3, **greedy(6))
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and all(v <= 0 for v in top.values())
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy: the top token


def seeded(max_tokens: int, **kw: Any) -> dict[str, Any]:
    """Seeded sampling: reproducible, and more varied than the tiny model's greedy output
    (which repeats the prompt's last token)."""
    return {"model": "tiny", "temperature": 1.0, "seed": 1, "max_tokens": max_tokens, **kw}


def offline_seeded(llm: LLM, max_tokens: int) -> Any:
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=max_tokens)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_stop_string_cuts_text(client: openai.OpenAI, llm: LLM) -> None:
    text = offline_seeded(llm, 16).text
    assert client.completions.create(prompt=PROMPT, **seeded(16)).choices[0].text == text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    assert expected
    r = client.completions.create(prompt=PROMPT, stop=[stop, "never-seen"], **seeded(16))
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens < 16
    streamed = list(client.completions.create(prompt=PROMPT, stop=stop, stream=True, **seeded(16)))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(
        prompt=PROMPT, stop=stop, extra_body={"include_stop_str_in_output": True}, **seeded(16)
    )
    assert kept.choices[0].text == expected + stop


def test_stop_token_ids_leave_out_the_stop_token(client: openai.OpenAI, llm: LLM) -> None:
    ids = offline_seeded(llm, 12).token_ids
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])
    r = client.completions.create(
        prompt=PROMPT, extra_body={"stop_token_ids": [ids[k]]}, **seeded(12)
    )
    assert r.choices[0].text == llm.get_tokenizer().decode(ids[:k])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == ids[k]
    assert r.usage.completion_tokens == k + 1


def test_echo(client: openai.OpenAI) -> None:
    plain = client.completions.create(prompt=PROMPT, **greedy(5)).choices[0].text
    r = client.completions.create(prompt=PROMPT, echo=True, **greedy(5))
    assert r.choices[0].text == PROMPT + plain
    chunks = list(client.completions.create(prompt=PROMPT, echo=True, stream=True, **greedy(5)))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain


# ---- chat --------------------------------------------------------------------------------
def test_chat_equals_offline_llm_streamed_and_not(client: openai.OpenAI, llm: LLM) -> None:
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = client.chat.completions.create(messages=CHAT, **greedy(10))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        messages=CHAT, stream=True, stream_options={"include_usage": True},
        max_completion_tokens=10, model="tiny", temperature=0,
    )
    *chunks, usage = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert usage.choices == []  # the prompt's blocks may now be cached: compare the counts
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (
        r.usage.prompt_tokens, r.usage.completion_tokens)


def test_chat_content_parts_n_and_logprobs(client: openai.OpenAI) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    plain = client.chat.completions.create(messages=CHAT, **greedy(4))
    r = client.chat.completions.create(
        messages=parts, n=2, logprobs=True, top_logprobs=2, **greedy(4)
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content == plain.choices[0].message.content for c in r.choices)
    assert r.usage.completion_tokens == 8
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)


# ---- errors ------------------------------------------------------------------------------
def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": "x"}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"max_tokens": 5, "extra_body": {"min_tokens": 20}}, "min_tokens"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
    ],
)
def test_bad_completion_requests(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**{"model": "tiny", "prompt": PROMPT, **kwargs})
    assert info.value.status_code == 400 and info.value.param == param
    assert info.value.type == "invalid_request_error"


def test_error_shapes_and_server_survives(client: openai.OpenAI, base_url: str) -> None:
    bad_json = httpx.post(f"{base_url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in error_of(bad_json)["message"]
    missing = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny"})
    assert missing.status_code == 400 and error_of(missing)["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert info.value.body["message"] == "The model `gpt-4` does not exist."
    assert info.value.param == "model" and info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=4)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert info.value.body["message"] == (
        "This model's maximum context length is 512 tokens. However, you requested 604 tokens "
        "(600 in the messages, 4 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    long_chat = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=long_chat)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, top_logprobs=2)
    assert info.value.param == "top_logprobs"
    not_found = httpx.get(f"{base_url}/v1/nothing")
    assert not_found.status_code == 404 and error_of(not_found)["message"] == "Not Found"
    assert client.completions.create(prompt=PROMPT, **greedy(2)).usage.completion_tokens == 2


# ---- disconnects, ops, state -------------------------------------------------------------
def test_stream_disconnect_aborts_in_engine(
    client: openai.OpenAI, engine: AsyncLLMEngine, store: RecordingStore
) -> None:
    stream = client.completions.create(
        prompt=PROMPT, stream=True, n=2, extra_body={"ignore_eos": True}, **greedy(480)
    )
    chunks = iter(stream)
    first = next(chunks)
    next(chunks)
    stats = engine_stats(engine)
    assert stats.num_running + stats.num_waiting == 2
    stream.close()
    wait_until_idle(engine)
    status, fields = store.final(first.id)
    assert status == "cancelled" and fields["output_tokens"] < 2 * 480


def test_non_stream_disconnect_aborts_in_engine(
    base_url: str, engine: AsyncLLMEngine, store: RecordingStore
) -> None:
    body = {"prompt": PROMPT, "ignore_eos": True, **greedy(480)}
    started = time.monotonic()
    # the whole run first, unhurried (httpx's default 5 s is one busy box's 480 steps)
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).status_code == 200
    whole = time.monotonic() - started
    assert whole > 0.15, "too fast to disconnect in the middle"
    with pytest.raises(httpx.ReadTimeout):  # gone a third of the way in, whatever the box's speed
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=whole / 3)
    wait_until_idle(engine)
    status, fields = store.final()
    assert status == "cancelled" and fields["output_tokens"] < 480


def test_disconnect_while_blocked_on_a_slow_client(engine: AsyncLLMEngine) -> None:
    """The client goes away while the response is stuck writing to it (the body generator is
    suspended at a yield, where no cancellation reaches it): the response closes it, and the
    engine aborts."""
    store = RecordingStore()
    app = build_app(LocalBackend(engine, "tiny"), store=store)
    body = {"prompt": PROMPT, "stream": True, "ignore_eos": True, **greedy(480)}
    asyncio.run(asyncio.wait_for(_send_and_stall(app, json.dumps(body).encode(), store), 10))
    wait_until_idle(engine)
    ((_, fields),) = [records[-1] for records in store.records.values()]
    assert fields["output_tokens"] < 480


async def _send_and_stall(app: Any, body: bytes, store: RecordingStore) -> None:
    """Drive the ASGI app by hand: after two body chunks `send` blocks forever (a client
    that stopped reading), then the client disconnects."""
    gone, incoming, sent = asyncio.Event(), [{"type": "http.request", "body": body}], []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message)
            if len(sent) == 2:
                gone.set()
                await asyncio.Event().wait()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "query_string": b"",
        "raw_path": b"/v1/completions", "root_path": "", "client": ("127.0.0.1", 1),
        "headers": [(b"content-type", b"application/json")], "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    # Closed before the response returns, not later by garbage collection.
    assert [records[-1][0] for records in store.records.values()] == ["cancelled"]


def test_state_store_records_lifecycle(client: openai.OpenAI, store: RecordingStore) -> None:
    r = client.completions.create(prompt=PROMPT, n=2, **greedy(3))
    store.final(r.id)
    (created, queued), (status, fields) = store.records[r.id]
    assert created == "queued" and queued["prompt_tokens"] == r.usage.prompt_tokens
    assert queued["n"] == 2 and queued["stream"] is False and queued["model"] == "tiny"
    assert status == "finished"
    assert fields == {"output_tokens": 6, "finish_reason": "length"}


def test_ops_routes(client: openai.OpenAI, base_url: str) -> None:
    client.completions.create(prompt=PROMPT, **greedy(3))
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/ready").status_code == 200
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.model_extra["max_model_len"] == MAX_MODEL_LEN
    text = httpx.get(f"{base_url}/metrics").text
    assert 'pdserve:time_to_first_token_seconds_count{model_name="tiny"}' in text
    for name in ("inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"pdserve:{name}" in text
    assert 'pdserve:request_success_total{finished_reason="length",model_name="tiny"}' in text
    assert 'pdserve:num_requests_running{model_name="tiny"} 0.0' in text


# ---- auth and backend failures (in-process ASGI client) ----------------------------------
class FailingBackend:
    """The local backend, except that every generation fails and it is never ready."""

    def __init__(self, inner: LocalBackend, retryable: bool) -> None:
        self.inner, self.retryable = inner, retryable

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any) -> Any:
        raise BackendError("no decode worker is available", retryable=self.retryable)
        yield  # an async generator, like a real backend

    async def ready(self) -> bool:
        return False


@pytest.mark.parametrize(("retryable", "status"), [(True, 503), (False, 500)])
def test_backend_errors(engine: AsyncLLMEngine, retryable: bool, status: int) -> None:
    backend = FailingBackend(LocalBackend(engine, "tiny"), retryable)
    with TestClient(build_app(backend)) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": "hi", "stream": stream})
            assert r.status_code == status
            assert "no decode worker is available" in error_of(r)["message"]
            assert "Traceback" not in r.text
        assert http.get("/ready").status_code == 503
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("guided_regex", "(ab", "regex"),
    ("guided_grammar", "root ::= undefined_rule", "grammar"),
    ("response_format", {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}, "json"),
])
def test_a_constraint_the_engine_cannot_compile_is_a_400(
    engine: AsyncLLMEngine, field: str, value: Any, kind: str
) -> None:
    """The engine's ValueError at add_request (the compiler's message) is the client's 400,
    naming the request field the constraint came from, before any stream starts."""
    with TestClient(build_app(LocalBackend(engine, "tiny"))) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 4, "stream": stream, field: value})
            assert r.status_code == 400, r.text
            error = error_of(r)
            assert (error["type"], error["param"]) == ("invalid_request_error", field)
            assert error["message"].startswith(f"structured_outputs.{kind} does not compile")
    wait_until_idle(engine)


class BrokenStore:
    async def create(self, request_id: str, **fields: Any) -> None:
        raise ConnectionError("redis is down")

    async def transition(self, request_id: str, status: str, **fields: Any) -> None:
        raise ConnectionError("redis is down")


def test_state_store_failure_does_not_fail_requests(engine: AsyncLLMEngine) -> None:
    with TestClient(build_app(LocalBackend(engine, "tiny"), store=BrokenStore())) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPT, **greedy(2)})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_api_key(engine: AsyncLLMEngine) -> None:
    with TestClient(build_app(LocalBackend(engine, "tiny"), api_key="sesame")) as http:
        denied = http.get("/v1/models")
        assert denied.status_code == 401 and error_of(denied)["code"] == "invalid_api_key"
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = http.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
        assert http.get("/health").status_code == 200
