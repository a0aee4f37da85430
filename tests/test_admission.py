"""`--max-concurrent-requests`: past N generation requests in flight, the gateway answers 429
with Retry-After at once, in OpenAI's error shape, without reading the body; other routes stay
open, and a request is served again as soon as a slot frees. (The gateway over the in-process
tiny engine; the live cluster under overload is tests/test_soak.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from engine.async_engine import AsyncLLMEngine
from engine.sampling_params import SamplingParams
from gateway.app import build_app
from gateway.backend import TokenDelta
from gateway.local_backend import LocalBackend
from pdserve.ports import free_port

LIMIT = 2
STREAM = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "stream": True}


class HeldBackend(LocalBackend):
    """Every generation stops after its first token until its client goes away: a request in
    flight for as long as the test needs it (a real one may finish in a blink)."""

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        async with contextlib.aclosing(super().generate(request_id, prompt_token_ids,
                                                        params)) as deltas:
            yield TokenDelta((await anext(deltas)).token_ids[:1])
            await asyncio.Event().wait()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32")
    yield engine
    engine.shutdown()


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """uvicorn serving `app` on a free loopback port, in this event loop."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def _open_stream(http: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> Any:
    """A completion streaming (its first chunk read): one request in flight until closed.
    Returns the line iterator: dropping it would close the connection (hang up)."""
    response = await stack.enter_async_context(http.stream("POST", "/v1/completions",
                                                           json=STREAM))
    assert response.status_code == 200
    lines = response.aiter_lines()
    while not (await anext(lines)).startswith("data:"):
        pass
    return lines


async def _status_of_a_stream(http: httpx.AsyncClient) -> int:
    """The status of a streamed completion, hung up on at once."""
    async with http.stream("POST", "/v1/completions", json=STREAM) as response:
        return response.status_code


async def _status_line_without_body(url: httpx.URL) -> bytes:
    """POST a completion announcing a 1 MB body and send none of it: the first response line."""
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.readline(), timeout=5)
    finally:
        writer.close()


def _check_overloaded(r: httpx.Response) -> None:
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["param"] is None
    assert error["message"] == (f"The server is overloaded: {LIMIT} requests are in flight, its "
                                "limit. Please retry after 1 s.")


async def test_past_the_limit_requests_get_429_at_once_until_a_slot_frees(
    engine: AsyncLLMEngine,
) -> None:
    app = build_app(HeldBackend(engine, "tiny"), max_concurrent_requests=LIMIT)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http, \
            contextlib.AsyncExitStack() as stack:
        streams = [await _open_stream(http, stack) for _ in range(LIMIT)]
        started = time.monotonic()
        _check_overloaded(await http.post("/v1/completions", json=STREAM))
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
        _check_overloaded(await http.post("/v1/chat/completions", json=chat))
        status = await _status_line_without_body(http.base_url)
        assert status == b"HTTP/1.1 429 Too Many Requests\r\n"
        assert time.monotonic() - started < 2.0  # at once: nothing waited for a slot
        for path in ("/v1/models", "/health", "/metrics"):  # not generation: never refused
            assert (await http.get(path)).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert "pdserve:requests_rejected_total 3.0" in metrics

        await streams[0].aclose()  # hang up: the slot frees once the gateway has seen it
        deadline = time.monotonic() + 10
        while (status := await _status_of_a_stream(http)) == 429:
            assert time.monotonic() < deadline, "the slot never freed"
            await asyncio.sleep(0.05)
        assert status == 200
