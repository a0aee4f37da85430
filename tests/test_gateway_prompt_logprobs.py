"""Prompt logprobs through the OpenAI gateway (colocated, the official `openai` client):
`echo` + `logprobs` on completions (the prompt's tokens lead the choice's logprobs, as lm-eval's
loglikelihood reads them), `echo` with `max_tokens` 0, vLLM's `prompt_logprobs` field,
`usage.prompt_tokens_details.cached_tokens` and `continuous_usage_stats`. The truth is HF's
log-softmax."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from gateway.app import build_app
from gateway.local_backend import LocalBackend

IDS = list(range(100, 121))  # 21 prompt tokens
GREEDY: Any = {"model": "tiny", "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", max_model_len=256,
                                      kv_cache_memory=16 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def http(engine: AsyncLLMEngine) -> Iterator[TestClient]:
    with TestClient(build_app(LocalBackend(engine, "tiny"))) as c:
        yield c


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)


@pytest.fixture(scope="module")
def hf_ref(tiny_llama_dir: str) -> torch.Tensor:
    """HF's log-softmax at each position of IDS: [P, V]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([IDS])).logits[0].float(), dim=-1)


def _token(engine: AsyncLLMEngine, token_id: int) -> str:
    return engine.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def test_echo_logprobs_lead_with_the_prompt_equal_to_hf(
    client: openai.OpenAI, engine: AsyncLLMEngine, hf_ref: torch.Tensor
) -> None:
    plain = client.completions.create(prompt=IDS, max_tokens=3, logprobs=2, **GREEDY)
    r = client.completions.create(prompt=IDS, max_tokens=3, logprobs=2, echo=True, **GREEDY)
    choice, gen = r.choices[0], plain.choices[0]
    prompt_text = engine.engine.tokenizer.decode(IDS)
    assert choice.text == prompt_text + gen.text
    lp, n = choice.logprobs, len(IDS)
    assert lp.tokens == [_token(engine, t) for t in IDS] + gen.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, n):
        expect = hf_ref[p - 1]
        assert lp.token_logprobs[p] == pytest.approx(expect[IDS[p]].item(), abs=1e-4)
        top = expect.topk(2).indices.tolist()
        alternatives = {_token(engine, t) for t in top} | {_token(engine, IDS[p])}
        assert set(lp.top_logprobs[p]) == alternatives
    assert lp.token_logprobs[n:] == pytest.approx(gen.logprobs.token_logprobs, abs=1e-5)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 3


def test_lm_eval_loglikelihood_request(http: TestClient, hf_ref: torch.Tensor) -> None:
    """lm-eval local-completions' loglikelihood body, read as lm-eval reads it."""
    body = {"model": "tiny", "prompt": IDS, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    ctxlen = 15  # context IDS[:15], continuation IDS[15:]
    continuation = logprobs["token_logprobs"][ctxlen:-1]
    expect = [hf_ref[p - 1][IDS[p]].item() for p in range(ctxlen, len(IDS))]
    assert sum(continuation) == pytest.approx(sum(expect), abs=1e-3)
    tops = logprobs["top_logprobs"][ctxlen:-1]
    greedy = [hf_ref[p - 1].argmax().item() == IDS[p] for p in range(ctxlen, len(IDS))]
    tokens = logprobs["tokens"][ctxlen:-1]
    assert [max(t, key=t.get) == tok for t, tok in zip(tops, tokens)] == greedy


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(
    client: openai.OpenAI, engine: AsyncLLMEngine, hf_ref: torch.Tensor
) -> None:
    r = client.completions.create(prompt=IDS, max_tokens=0, logprobs=0, echo=True, **GREEDY)
    choice = r.choices[0]
    assert choice.text == engine.engine.tokenizer.decode(IDS)
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(IDS)
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(hf_ref[-2][IDS[-1]].item(),
                                                               abs=1e-4)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(IDS), 0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(prompt=IDS, max_tokens=0, **GREEDY)


def test_prompt_logprobs_field_in_vllm_shape(
    client: openai.OpenAI, engine: AsyncLLMEngine, hf_ref: torch.Tensor
) -> None:
    r = client.completions.create(prompt=IDS, max_tokens=2, extra_body={"prompt_logprobs": 1},
                                  **GREEDY)
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(IDS)
    for p in range(1, len(IDS)):
        expect, target = hf_ref[p - 1], IDS[p]
        chosen = entries[p][str(target)]
        assert chosen["logprob"] == pytest.approx(expect[target].item(), abs=1e-4)
        assert chosen["rank"] == int((expect > expect[target]).sum()) + 1
        assert chosen["decoded_token"] == _token(engine, target)
        top = expect.argmax().item()
        assert entries[p][str(top)]["rank"] == 1
        assert set(entries[p]) == {str(target), str(top)}
    assert "prompt_logprobs" not in client.completions.create(
        prompt=IDS, max_tokens=1, **GREEDY).choices[0].model_dump()
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(prompt=IDS, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1}, **GREEDY)


def test_chat_prompt_logprobs(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(messages=messages, max_tokens=2,
                                       extra_body={"prompt_logprobs": 0}, **GREEDY)
    entries = r.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == r.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])


def test_cached_tokens_after_a_repeated_prompt(
    client: openai.OpenAI, engine: AsyncLLMEngine
) -> None:
    ids = list(range(300, 340))  # 40 tokens: two full blocks of 16 (and a part)
    first = client.completions.create(prompt=ids, max_tokens=1, **GREEDY)
    again = client.completions.create(prompt=ids, max_tokens=1, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block = engine.engine.config.cache.block_size
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * block == 32


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(prompt=IDS, max_tokens=4, stream=True,
                                            stream_options=options, **GREEDY))
    *pieces, last = chunks
    assert pieces and all(c.usage is not None for c in pieces)
    counts = [c.usage.completion_tokens for c in pieces]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c.usage.prompt_tokens == len(IDS) for c in pieces)
    assert last.choices == [] and last.usage.completion_tokens == 4
    plain = list(client.completions.create(prompt=IDS, max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
    assert all(c.usage is None for c in plain[:-1])
    chat = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options=options, **GREEDY))
    assert all(c.usage is not None for c in chat)
    assert chat[-1].usage.completion_tokens == 3
