"""The load test's client, runner and report against an in-process fake OpenAI server
(httpx.MockTransport): request bodies, SSE parsing, failures, the time bound, tables, plots."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from typing import Any

import httpx
import pytest

from loadtest import plots
from loadtest.client import ClientConfig, StreamClient
from loadtest.metrics import SLO
from loadtest.processes import ClientProcesses
from loadtest.record import RequestRecord
from loadtest.report import format_sweep, markdown_table
from loadtest.runner import RunConfig, prefix_reuse, run_rate, sweep
from loadtest.scrape import deltas, parse_counters
from loadtest.workloads import RequestSpec


def spec(n: int = 3, ids: list[int] | None = None) -> RequestSpec:
    return RequestSpec("hello there", ids, [{"role": "user", "content": "hello there"}], 2, n)


def sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def fake_server(token_delay_s: float = 0.0, status: int = 200, mid_stream_error: bool = False,
                seen: list[dict[str, Any]] | None = None) -> httpx.MockTransport:
    """Streams max_tokens one-character tokens, as pdserve and vLLM do: a role chunk (chat),
    one chunk per token, an empty finish chunk, the usage chunk, [DONE]."""

    served = [0]

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":  # a counter and a histogram, as prometheus_client
            return httpx.Response(200, text=(
                "# TYPE fake:requests counter\n"
                f'fake:requests_total{{role="a"}} {served[0]}.0\n'
                'fake:requests_total{role="b"} 1.0\n'
                "fake:requests_created 1.7e9\nfake:running 3.0\n"
                f"fake:latency_seconds_sum {served[0] * 0.5}\nfake:latency_seconds_count 2\n"))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        served[0] += 1
        if seen is not None:
            seen.append(body)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "bad request"}})
        chat = "messages" in body
        n = body["max_completion_tokens"] if chat else body["max_tokens"]

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            piece = {"delta": {"content": text}} if chat else {"text": text}
            return {"index": 0, **piece, "finish_reason": finish}

        async def stream():
            if chat:
                yield sse({"id": "r1", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(n):
                await asyncio.sleep(token_delay_s)
                if mid_stream_error and i == 1:
                    yield sse({"error": {"message": "worker lost"}})
                    break
                yield sse({"id": "r1", "choices": [choice("ab"[i % 2])]})
            yield sse({"id": "r1", "choices": [choice("", "length")]})
            yield sse({"id": "r1", "choices": [], "usage": {
                "prompt_tokens": 2, "completion_tokens": n, "total_tokens": 2 + n}})
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def client(transport: httpx.MockTransport, **kw: Any) -> StreamClient:
    return StreamClient(ClientConfig("http://fake:1/v1", **kw), transport=transport)


def test_request_bodies():
    c = client(fake_server())
    c.model = "m"
    body = c.payload(spec(5, ids=[7, 8]))
    assert body == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.0, "prompt": [7, 8], "max_tokens": 5, "ignore_eos": True}
    assert c.payload(spec(5))["prompt"] == "hello there"  # no ids: text
    c = client(fake_server(), prompt_format="text", ignore_eos=False, logprobs=True,
               extra_body={"top_k": 1})
    body = c.payload(spec(5, ids=[7, 8]))
    assert body["prompt"] == "hello there" and body["logprobs"] == 0 and body["top_k"] == 1
    assert "ignore_eos" not in body
    chat = client(fake_server(), endpoint="chat", logprobs=True).payload(spec(4))
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert (chat["max_completion_tokens"], chat["logprobs"], chat["top_logprobs"]) == (4, True, 0)
    with pytest.raises(ValueError):
        ClientConfig("http://x", endpoint="embeddings")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_streamed_request_fills_its_timeline(endpoint):
    async with client(fake_server(0.01), endpoint=endpoint) as c:
        assert c.model == "fake-model"
        r = RequestRecord(0, 2, 4)
        await c.send(spec(4), r, lambda: asyncio.get_running_loop().time())
    assert r.ok and r.request_id == "r1"
    assert len(r.chunk_at) == 4  # neither the role chunk nor the empty finish chunk
    assert (r.prompt_tokens, r.completion_tokens) == (2, 4)
    assert r.sent_at < r.chunk_at[0] <= r.chunk_at[-1] <= r.done_at


async def test_several_servers_take_requests_in_turn():
    hosts: list[str] = []
    inner = fake_server()

    async def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(f"{request.url.host}:{request.url.port}{request.url.path}")
        return await inner.handle_async_request(request)

    cfg = ClientConfig("http://a:1/v1, http://b:2", endpoint="chat")
    assert cfg.roots == ["http://a:1", "http://b:2"]
    async with StreamClient(cfg, transport=httpx.MockTransport(handler)) as c:
        for i in range(3):
            r = RequestRecord(i, 2, 2)
            await c.send(spec(2), r, lambda: 1.0)
            assert r.ok
    assert hosts == ["a:1/v1/models", "a:1/v1/chat/completions", "b:2/v1/chat/completions",
                     "a:1/v1/chat/completions"]
    with pytest.raises(ValueError, match="names no server"):
        StreamClient(ClientConfig(" , "))


async def test_failures_are_recorded_not_raised():
    clock = lambda: 1.0
    async with client(fake_server(status=400)) as c:
        r = RequestRecord(0, 2, 4)
        await c.send(spec(4), r, clock)
    assert r.error.startswith("HTTP 400") and "bad request" in r.error
    async with client(fake_server(mid_stream_error=True)) as c:
        r = RequestRecord(0, 2, 4)
        await c.send(spec(4), r, clock)
    assert r.error == "stream error: worker lost" and len(r.chunk_at) == 1
    async with client(fake_server()) as c:
        r = RequestRecord(0, 2, 0)
        await c.send(spec(0), r, clock)
    assert r.error == "the stream ended with no output"


def test_client_processes_are_at_least_one():
    with pytest.raises(ValueError, match="client_processes must be >= 1"):
        RunConfig(client_processes=0)
    with pytest.raises(ValueError, match="client processes must be >= 2"):
        ClientProcesses(ClientConfig("http://fake:1"), "m", 1)


async def test_a_run_stops_at_its_max_duration():
    # 5 requests due at 0, 0.25, 0.5, 0.75, 1 s, each 20 tokens 0.05 s apart: none can finish
    # by 0.6 s, when the run stops
    cfg = RunConfig((4.0,), 5, arrival="constant", max_duration_s=0.6, progress=False)
    async with client(fake_server(0.05)) as c:
        run = await run_rate(c, [spec(20)] * 5, 4.0, cfg)
    assert run["timed_out"] is True
    assert (run["completed"], run["failed"], run["not_sent"]) == (0, 3, 2)
    assert all(r["error"].startswith("cancelled") for r in run["requests"])
    assert 0.6 <= run["duration_s"] < 1.5


async def test_a_sweep_warms_up_then_runs_each_rate_on_its_own_requests():
    seen: list[dict[str, Any]] = []
    specs = [spec(2, ids=[i]) for i in range(7)]
    cfg = RunConfig((20.0, math.inf), 3, num_warmups=1, max_concurrency=2, progress=False,
                    slo=SLO(ttft_s=5.0), metrics_urls=("http://fake:1/metrics",))
    async with client(fake_server(0.001, seen=seen)) as c:
        runs = await sweep(c, specs, cfg)
    assert [b["prompt"] for b in seen[:1]] == [[0]]
    assert sorted(b["prompt"][0] for b in seen[1:]) == list(range(1, 7))
    for run in runs:
        assert (run["completed"], run["failed"], run["not_sent"]) == (3, 0, 0)
        assert run["goodput"] == pytest.approx(run["request_throughput"])
        assert run["output_tokens"] == 6
        assert run["server_counters"] == {"http://fake:1/metrics": {
            "fake:requests_total": 3.0, "fake:latency_seconds_sum": 1.5,
            "fake:latency_seconds_count": 0.0}}
    with pytest.raises(ValueError, match="7 needed"):
        async with client(fake_server()) as c:
            await sweep(c, specs[:6], cfg)
    with pytest.raises(RuntimeError, match="warm-up"):
        async with client(fake_server(status=500)) as c:
            await sweep(c, specs, cfg)


def test_prefix_reuse_counts_hittable_tokens_of_sent_requests_against_server_hits():
    specs = [dataclasses.replace(spec(4), reused_len=n) for n in (0, 3, 4)]
    sent = [RequestRecord(i, 4, 2) for i in (0, 2)]  # request 1 never went out
    pages = {"http://a/metrics": {"pdserve:prefix_cache_hits_total": 2.0},
             "http://b/metrics": {"vllm:prefix_cache_hits_total": 1.0, "x_total": 9.0}}
    assert prefix_reuse(specs, sent, pages) == {
        "reused_prompt_tokens": 4, "prefix_cache_hit_tokens": 3.0, "prefix_hit_rate": 0.75}
    assert prefix_reuse(specs, sent, {})["prefix_hit_rate"] is None  # no pages: unknown
    assert prefix_reuse(specs, sent[:1], pages)["prefix_hit_rate"] is None  # nothing hittable


def test_counters_are_cumulative_samples_summed_over_labels():
    page = ('# HELP x_total a counter\nx_total{a="1"} 2\nx_total{a="2",b="q r"} 3.5\n'
            "x_created 17\ny 4\nz_count 1e3 1700000000\nbad_total NaNx\n")
    assert parse_counters(page) == {"x_total": 5.5, "z_count": 1000.0}
    assert deltas({"u": {"x_total": 1.0}}, {"u": {"x_total": 4.0, "new_total": 2.0}}) == {
        "u": {"x_total": 3.0}}


# ---- report -----------------------------------------------------------------------------------
async def _report() -> dict[str, Any]:
    cfg = RunConfig((50.0, math.inf), 4, num_warmups=0, progress=False, slo=SLO(ttft_s=1.0))
    async with client(fake_server(0.001)) as c:
        runs = await sweep(c, [spec(3)] * 8, cfg)
    config = {"base_url": "http://fake:1", "endpoint": "completions", "slo_ttft_ms": 1000.0}
    return {"label": "fake", "model": "fake-model", "config": config, "runs": runs}


async def test_tables_show_every_rate():
    report = await _report()
    text = format_sweep(report)
    assert "request rate 50/s" in text and "request rate inf/s" in text
    assert "completed / failed / not sent      4 / 0 / 0" in text
    table = markdown_table([report, {**report, "label": "other"}]).splitlines()
    assert len(table) == 2 + 4
    assert table[2].startswith("| fake | 50 | 4 | 0 |")
    assert table[5].startswith("| other | inf | 4 | 0 |")


async def test_plots(tmp_path, monkeypatch, capsys):
    report = await _report()
    samples = plots.latency_samples(report["runs"][0])
    assert [len(samples[k]) for k in ("TTFT", "TPOT", "ITL", "E2E")] == [4, 4, 8, 4]
    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    assert plots.write_plots(report, tmp_path, "x") == []
    assert "matplotlib is not installed" in capsys.readouterr().err
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    paths = plots.write_plots(report, tmp_path / "png", "serve")
    assert [p.name for p in paths] == ["serve_latency_cdf.png", "serve_throughput.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
