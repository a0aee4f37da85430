"""loadtest/processes.py: a run's requests sent from two client processes to a real HTTP server
(a streaming stand-in served by uvicorn in a thread): every request's timeline comes back under
its own index on the run's clock, and --max-duration cuts the processes' requests alike."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from loadtest.client import ClientConfig, StreamClient
from loadtest.processes import ClientProcesses
from loadtest.runner import RunConfig, run_rate
from loadtest.workloads import RequestSpec
from pdserve.ports import free_port

TOKEN_DELAY_S = 0.02


async def _completions(request: Request) -> StreamingResponse:
    body = await request.json()
    n = body["max_tokens"]

    async def events():
        for _ in range(n):
            await asyncio.sleep(TOKEN_DELAY_S)
            yield f"data: {json.dumps({'id': 'r', 'choices': [{'index': 0, 'text': 'a'}]})}\n\n"
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        yield f"data: {json.dumps({'id': 'r', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    app = Starlette(routes=[Route("/v1/completions", _completions, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _spec(i: int, tokens: int) -> RequestSpec:
    return RequestSpec("", [1, 2, 3 + i], [], 3, tokens)


async def _run(url: str, specs: list[RequestSpec], rate: float, **cfg) -> dict:
    config = ClientConfig(url, model="stand-in")
    run_cfg = RunConfig((rate,), len(specs), arrival="constant", progress=False,
                        client_processes=2, **cfg)
    async with StreamClient(config) as client:
        with ClientProcesses(config, client.model, 2) as processes:
            return await run_rate(client, specs, rate, run_cfg, processes)


def test_two_processes_send_every_request_on_the_runs_clock(server_url):
    specs = [_spec(i, 3 + i % 3) for i in range(6)]
    run = asyncio.run(_run(server_url, specs, 20.0))
    assert (run["completed"], run["failed"], run["not_sent"], run["timed_out"]) == (6, 0, 0, False)
    requests = sorted(run["requests"], key=lambda r: r["index"])
    assert [r["index"] for r in requests] == list(range(6))
    for r, spec in zip(requests, specs):
        assert r["scheduled_at"] == pytest.approx(r["index"] / 20.0)  # constant arrivals
        assert r["scheduled_at"] <= r["sent_at"] < r["chunk_at"][0] <= r["done_at"]
        assert r["completion_tokens"] == spec.output_len == len(r["chunk_at"])
    assert run["duration_s"] >= requests[-1]["done_at"]


def test_max_duration_cuts_the_requests_of_every_process(server_url):
    # 6 requests due 0.25 s apart, each 50 tokens 0.02 s apart (1 s): the three due by 0.6 s
    # are sent (from both processes), none ends by then, the other three are never sent
    run = asyncio.run(_run(server_url, [_spec(i, 50) for i in range(6)], 4.0,
                           max_duration_s=0.6))
    assert run["timed_out"] is True
    assert (run["completed"], run["failed"], run["not_sent"]) == (0, 3, 3)
    assert all(r["error"].startswith("cancelled") for r in run["requests"])
