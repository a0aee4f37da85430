"""The disaggregated pipeline as the README runs it: `pdserve up` (Redis, tokenizer, 1 prefill
and 1 decode worker, gateway as separate processes) on the bundled model, driven with the
official `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from cluster import http_get, run_cluster
from live_checks import metric, wait_idle, worker_metrics_url

from pdserve import __version__

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire spans many centuries. It began when Augustus became the "
    "first emperor, and over the following years the empire grew to cover most of Europe, "
    "North Africa and the Middle East. Describe its economy:",
    "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    "Q: What is the boiling point of water at sea level?\nA:",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    with run_cluster(tmp, "--prefill", "1", "--decode", "1",
                     "--kv-cache-memory", str(128 << 20), "--max-model-len", "2048") as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def colocated_llm():
    from pdserve import LLM

    # the cluster's settings (dtype auto: the bundled GGUF kept quantized on the CPU), so the
    # split is compared with the same model
    return LLM(kv_cache_memory=128 << 20, max_model_len=2048)


@pytest.fixture(scope="module")
def colocated(colocated_llm):
    from pdserve import SamplingParams

    return colocated_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24),
                                  use_tqdm=False)


@pytest.fixture(scope="module")
def colocated_texts(colocated):
    return [o.outputs[0].text for o in colocated]


def test_disaggregated_greedy_equals_colocated(client, colocated_texts):
    for prompt, expected in zip(PROMPTS, colocated_texts):
        r = client.completions.create(model="HuggingFaceTB/SmolLM2-135M-Instruct",
                                      prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == expected
    tok_counts = [client.completions.create(model=None, prompt=p, max_tokens=1).usage.prompt_tokens
                  for p in PROMPTS[:1]]
    assert tok_counts[0] > 32  # spans several KV blocks of 16


def test_echo_logprobs_equal_colocated_prompt_logprobs(cluster, colocated_llm):
    """lm-eval's loglikelihood request: the prompt's logprobs, computed by the prefill worker,
    equal the colocated engine's, also on a gateway that would prefill such a short prompt on
    the decode worker (--local-prefill-max-tokens); the prefill worker's cache hits reach
    usage.prompt_tokens_details."""
    from cluster import extra_gateway

    from pdserve import SamplingParams

    (ref,) = colocated_llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
        use_tqdm=False)
    ids = ref.prompt_token_ids
    expected = [None] + [step[t].logprob for t, step in zip(ids[1:], ref.prompt_logprobs[1:])]
    generated = ref.outputs[0]
    expected.append(generated.logprobs[0][generated.token_ids[0]].logprob)
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "seed": 1234}
    with extra_gateway(cluster, "--local-prefill-max-tokens", "4096") as (local_url, _):
        for url in (cluster.url, local_url):
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert got[0] is None and len(got) == len(expected)
            assert got[1:] == pytest.approx(expected[1:], abs=1e-3)
        plain = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}  # > 2 blocks of 16
        for url in (cluster.url, local_url):  # hits on the prefill worker, on the decode worker
            usages = [httpx.post(url + "/v1/completions", json=plain, timeout=60).json()["usage"]
                      for _ in range(2)]
            assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 32, (url, usages)


def test_chat_streamed_equals_unstreamed(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=None, messages=messages, max_tokens=20,
                                          temperature=0)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    u = full.usage
    assert u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(client.chat.completions.create(
        model=None, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == u.completion_tokens


def test_n_logprobs_stop_and_usage(client):
    r = client.completions.create(model=None, prompt=PROMPTS[2], max_tokens=8, n=2,
                                  temperature=1.0, seed=3, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) <= 8
        assert all(len(top) <= 2 + 1 for top in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    prompt = "Write one long sentence about the ocean:"
    base = client.completions.create(model=None, prompt=prompt, max_tokens=24, temperature=0)
    text = base.choices[0].text
    assert len(text.strip()) > 12, text
    stop = text.strip()[8:11]
    cut = client.completions.create(model=None, prompt=prompt, max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_a_required_tool_call_after_a_tool_round_trip(client, bundled_tokenizer):
    """The history's call and result cross to the tokenizer service (rendered there with the
    shipped ChatML tool template), and the forced call fits the function's parameters."""
    import jsonschema

    from tokenizer_svc.chat_template import TOOLS_TEMPLATE_PATH

    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "Weather in Paris, then Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = client.chat.completions.create(model=None, messages=history, tools=tools,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [made] = choice.message.tool_calls
    assert made.function.name == "get_weather" and made.id.startswith("call_")
    jsonschema.validate(json.loads(made.function.arguments), params)
    local = [history[0], {**history[1], "tool_calls": [{**call, "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]]
    assert r.usage.prompt_tokens == len(bundled_tokenizer.apply_chat_template(
        local, tools=tools, chat_template=TOOLS_TEMPLATE_PATH.read_text(),
        add_generation_prompt=True, return_dict=False))


def test_request_state_and_registry_in_redis(cluster, client):
    from pdserve.cluster.state import RequestStore, connect

    r = client.completions.create(model=None, prompt=PROMPTS[1], max_tokens=4, temperature=0)

    async def state():
        c = connect(cluster.redis_url)
        try:
            return await RequestStore(c).get(r.id)
        finally:
            await c.aclose()

    s = asyncio.run(state())
    assert s["status"] == "finished"
    order = [float(s[f"ts_{k}"]) for k in
             ("queued", "prefilling", "transferring", "decoding", "finished")]
    assert order == sorted(order)
    workers = {w.role: w.address for w in cluster.workers()}
    assert set(workers) == {"tokenizer", "prefill", "decode"}
    assert s["prefill_worker"] == workers["prefill"] and s["decode_worker"] == workers["decode"]


def test_status_command_lists_the_workers(cluster):
    env = {**os.environ, "PDSERVE_CLUSTER_FILE": str(cluster.cluster_file)}
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--json"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    workers = json.loads(out)["workers"]
    roles = sorted(w["role"] for w in workers)
    assert roles == ["decode", "prefill", "tokenizer"]
    assert {w["role"]: w["kv_transport"] for w in workers} == {
        "decode": "auto", "prefill": "auto", "tokenizer": ""}  # `pdserve up`'s default
    assert {w["role"]: w["tensor_parallel_size"] for w in workers} == {
        "decode": 1, "prefill": 1, "tokenizer": 0}  # 0: not an engine
    via_gateway = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--json", "--gateway", cluster.url],
        capture_output=True, text=True, timeout=60, check=True).stdout
    assert sorted(w["role"] for w in json.loads(via_gateway)["workers"]) == roles
    table = subprocess.run([sys.executable, "-m", "pdserve.cli", "status"], env=env,
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "KV BLOCKS USED/TOTAL" in table and "TRANSPORT" in table and "decode" in table


def test_metrics_health_and_models(cluster):
    assert http_get(cluster.url + "/health")[0] == 200
    assert http_get(cluster.url + "/ready")[0] == 200
    status, body = http_get(cluster.url + "/v1/models")
    assert status == 200 and "SmolLM2" in body
    status, body = http_get(cluster.url + "/metrics")
    assert "pdserve:time_to_first_token_seconds" in body
    for w in cluster.workers():
        if w.metrics_address:
            _, body = http_get(f"http://{w.metrics_address}/metrics")
            assert "pdserve:kv_cache_usage_perc" in body


async def _stream_some(url: str, i: int, keep: int) -> None:
    async with httpx.AsyncClient(timeout=60) as h, h.stream(
        "POST", url + "/v1/completions",
        json={"prompt": PROMPTS[i % 3], "max_tokens": 300, "ignore_eos": True, "stream": True},
    ) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= keep:
                    return  # closing the stream mid-way


def test_closed_streams_leave_no_blocks_reserved(cluster):
    async def go():
        await asyncio.gather(*(_stream_some(cluster.url, i, keep=1 + i % 4) for i in range(8)))

    asyncio.run(go())
    deadline = time.monotonic() + 20
    while True:
        loads = cluster.loads()
        busy = {a: (x.num_running, x.num_waiting, x.num_total_blocks - x.num_free_blocks)
                for a, x in loads.items()}
        if all(v == (0, 0, 0) for v in busy.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(v == (0, 0, 0) for v in busy.values()), busy


def test_a_request_ending_at_its_first_token_frees_the_decode_reservation(cluster, client,
                                                                         colocated,
                                                                         bundled_tokenizer):
    """The prefill worker samples a stop token first and cuts off the push under way; the
    gateway cancels the decode worker's Generate, which frees the blocks reserved for the KV at
    once (not after the 30 s KV timeout) and counts no failed transfer."""
    first = colocated[0].outputs[0].token_ids[0]
    stop_reason = None if first == bundled_tokenizer.eos_token_id else first  # eos: null
    decode_metrics = worker_metrics_url(cluster, "decode")
    failures = metric(decode_metrics, "pdserve:kv_transfer_failures_total")
    for _ in range(3):
        r = client.completions.create(model=None, prompt=PROMPTS[0], max_tokens=24,
                                      temperature=0, extra_body={"stop_token_ids": [first]})
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
        assert r.choices[0].model_extra["stop_reason"] == stop_reason
    left = wait_idle(cluster, timeout_s=5)
    assert not any(any(x) for x in left.values()), f"(running, waiting, blocks) left: {left}"
    assert metric(decode_metrics, "pdserve:kv_transfer_failures_total") == failures


def test_the_first_tokens_stop_reason_is_null_for_eos_and_the_id_of_a_stop_token(client,
                                                                                colocated):
    """A prompt that ends an assistant turn: the prefill worker samples eos first and answers
    only "stop"; the stop reason is null, as colocated and vLLM give for eos (it was the eos
    id). A stop token id sampled first is the stop reason."""
    prompt = ("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
              "Hi! How can I help you today?")
    for stream in (False, True):
        r = client.completions.create(model=None, prompt=prompt, max_tokens=8, temperature=0,
                                      stream=stream)
        choice = (list(r)[-1] if stream else r).choices[0]
        assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", None)
        if not stream:
            assert (choice.text, r.usage.completion_tokens) == ("", 1)
    first = colocated[1].outputs[0].token_ids[0]
    r = client.completions.create(model=None, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [first]})
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", first)


def test_tokenize_and_detokenize_through_the_tokenizer_service(cluster, client,
                                                               bundled_tokenizer):
    """vLLM's /tokenize, /detokenize and /version on the disaggregated gateway, driven with the
    httpx client under the `openai` one: ids as the OpenAI routes count them."""
    http = client._client
    url = cluster.url
    chat = [{"role": "user", "content": "What is the boiling point of water?"}]
    tok = http.post(f"{url}/tokenize", json={"prompt": PROMPTS[2], "return_token_strs": True})
    assert tok.status_code == 200, tok.text
    body = tok.json()
    assert body["tokens"] == bundled_tokenizer.encode(PROMPTS[2])
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), 2048)
    assert body["token_strs"] == bundled_tokenizer.convert_ids_to_tokens(body["tokens"])
    usage = client.completions.create(model=None, prompt=PROMPTS[2], max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    conversation = http.post(f"{url}/tokenize", json={"messages": chat}).json()
    usage = client.chat.completions.create(model=None, messages=chat, max_tokens=1).usage
    assert usage.prompt_tokens == conversation["count"]
    text = http.post(f"{url}/detokenize", json={"tokens": body["tokens"]})
    assert text.json() == {"prompt": PROMPTS[2]}
    bad = http.post(f"{url}/detokenize", json={"tokens": [len(bundled_tokenizer)]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")
    empty = http.post(f"{url}/tokenize", json={"prompt": ""})
    assert (empty.status_code, empty.json()["error"]["param"]) == (400, "prompt")
    assert http.get(f"{url}/version").json() == {"version": __version__}


def test_token_controls_reach_both_workers(client, colocated_llm, bundled_tokenizer):
    """logit_bias, allowed_token_ids and bad_words travel with the request to the prefill
    worker (the first token) and the decode worker (the rest): equal to colocated."""
    from pdserve import SamplingParams

    yes, no = (bundled_tokenizer.encode(w)[0] for w in (" yes", " no"))
    cases = [dict(logit_bias={yes: 100.0}), dict(allowed_token_ids=[yes, no]),
             dict(bad_words=[" the", " of"])]
    for fields in cases:
        params = SamplingParams(temperature=0, max_tokens=8, **fields)
        expected = colocated_llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        body = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v)
                for k, v in fields.items()}
        r = client.completions.create(model=None, prompt=PROMPTS[1], max_tokens=8,
                                      temperature=0, **({"logit_bias": body.pop("logit_bias")}
                                                        if "logit_bias" in body else {}),
                                      extra_body=body)
        assert r.choices[0].text == expected.text, fields
    assert set(expected.token_ids).isdisjoint(bundled_tokenizer.encode(" the of"))


def test_responses_continue_a_conversation_stored_in_redis(cluster, client):
    """/v1/responses through the workers; the stored response lives in the cluster's Redis
    (any gateway continues it)."""
    from pdserve.cluster.response_store import RedisResponses
    from pdserve.cluster.state import connect

    first = client.responses.create(model=None, temperature=0, max_output_tokens=8,
                                    input="My name is Ada. Say hello.")
    second = client.responses.create(model=None, temperature=0, max_output_tokens=8,
                                     previous_response_id=first.id, input="What is my name?")
    replay = client.chat.completions.create(
        model=None, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": "My name is Ada. Say hello."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "What is my name?"}])
    assert second.output_text == replay.choices[0].message.content

    async def stored():
        redis = connect(cluster.redis_url)
        try:
            return await RedisResponses(redis).get(second.id)
        finally:
            await redis.aclose()

    kept = asyncio.run(stored())
    assert kept is not None and kept.response["output"][0]["content"][0]["text"] == \
        second.output_text
    assert [m["role"] for m in kept.messages] == ["user", "assistant", "user", "assistant"]


def test_32_concurrent_streams_complete(cluster, colocated_texts):
    aclient = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)

    async def one(i: int) -> tuple[str, str | None]:
        stream = await aclient.completions.create(model=None, prompt=PROMPTS[i % 3],
                                                  max_tokens=24, temperature=0, stream=True)
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def go():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(go())
    assert [text for text, _ in results] == [colocated_texts[i % 3] for i in range(32)]
    assert all(reason in ("length", "stop") for _, reason in results)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(cluster, client):
    h = httpx.Client(base_url=cluster.url, timeout=30)
    cases = [
        (dict(content=b"{not json", headers={"Content-Type": "application/json"}), 400),
        (dict(json={"model": "nope", "prompt": "x"}), 404),
        (dict(json={"prompt": "x", "max_tokens": -1}), 400),
        (dict(json={"prompt": "x", "temperature": -1}), 400),
        (dict(json={"prompt": "x" * 30000, "max_tokens": 4}), 400),
        (dict(json={"prompt": "x", "n": "many"}), 400),
    ]
    for kwargs, status in cases:
        r = h.post("/v1/completions", **kwargs)
        assert r.status_code == status, (kwargs, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    too_long = h.post("/v1/completions", json={"prompt": "x" * 30000, "max_tokens": 4}).json()
    assert "maximum context length" in too_long["error"]["message"]
    assert client.completions.create(model=None, prompt="ok", max_tokens=2).choices
