"""Idle keep-alive connections: neither side reuses a connection the other may be closing.

A server closes an idle connection after its keep-alive timeout; a client that sends on it at
that moment gets a reset (httpx.ReadError) for a request the server never saw. The load test's
client drops idle connections well before the common 5 s server timeout, and the gateway keeps
them open longer than the 5 s after which httpx/openai clients stop reusing them."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import uvicorn
from fastapi import FastAPI, Request

from loadtest.client import KEEPALIVE_S, ClientConfig, StreamClient
from pdserve.ports import free_port

HTTPX_DEFAULT_EXPIRY_S = httpx.Limits().keepalive_expiry  # what the openai client uses too


def _peer_app() -> FastAPI:
    app = FastAPI()

    @app.get("/peer")
    async def peer(request: Request) -> dict[str, int]:
        return {"port": request.client.port}

    return app


async def _ports_across_an_idle_gap(server_keep_alive_s: float, idle_s: float) -> list[int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_peer_app(), host="127.0.0.1", port=port,
                                           log_level="error",
                                           timeout_keep_alive=server_keep_alive_s))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    client = StreamClient(ClientConfig(f"http://127.0.0.1:{port}", model="m"))
    try:
        async with client:
            first = (await client.http.get(f"http://127.0.0.1:{port}/peer")).json()["port"]
            await asyncio.sleep(idle_s)
            second = (await client.http.get(f"http://127.0.0.1:{port}/peer")).json()["port"]
    finally:
        server.should_exit = True
        await serving
    return [first, second]


def test_the_load_client_drops_an_idle_connection_before_a_5s_server_would():
    assert KEEPALIVE_S < 5.0 - 1.0  # a second's margin under uvicorn's (and vLLM's) default
    # The server would still take the connection, the client has let it go: a new one.
    first, second = asyncio.run(_ports_across_an_idle_gap(KEEPALIVE_S + 2.0, KEEPALIVE_S + 0.5))
    assert first != second
    # Within its expiry the client reuses the connection (the pool does pool).
    first, second = asyncio.run(_ports_across_an_idle_gap(KEEPALIVE_S + 2.0, KEEPALIVE_S / 4))
    assert first == second


def test_the_gateway_keeps_idle_connections_past_the_clients_expiry(monkeypatch):
    from gateway import server

    seen: list[float] = []

    async def fake_serve(self: uvicorn.Server) -> None:
        seen.append(self.config.timeout_keep_alive)

    monkeypatch.setattr(uvicorn.Server, "serve", fake_serve)
    monkeypatch.delenv("PDSERVE_KEEP_ALIVE_SECONDS", raising=False)
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    asyncio.run(server._serve_app(object(), parser.parse_args([])))
    assert seen and seen[0] >= HTTPX_DEFAULT_EXPIRY_S + 5.0
