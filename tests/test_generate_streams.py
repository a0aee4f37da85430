"""GenerateStreams: many requests' Generate streams on one call, over real gRPC (an in-process
server whose Generate is a scripted stand-in; the real decode worker behind it is exercised by
the cluster tests, which take the shared call by default).

Each request reads as its own Generate call would: its messages then EOF, or its status; a
decode step's messages of every request leave in one reply; a cancel closes the request's
Generate (its cleanup runs) and nothing more comes for it; the call ending cancels every request
open on it; a draining worker refuses opens and ends the call once idle; a worker without the
call (an earlier version) is read through a Generate call per request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from polling import until

from decode_svc.generate_streams import GenerateStreams
from gateway.generate_streams import GenerateCalls
from pdserve.cluster.drain import DrainGate
from pdserve.cluster.grpc_server import make_server
from protos import decode_pb2, decode_pb2_grpc


class Script(decode_pb2_grpc.DecodeServicer):
    """A decode servicer whose Generate streams `tokens` tokens of the request, token i once
    the test's `advance()` ran i + 1 times (a request that comes late catches up: no step is
    missed), or fails with ValueError for a request id starting with "bad"."""

    def __init__(self, tokens: int = 3) -> None:
        self.tokens = tokens
        self.steps = [asyncio.Event() for _ in range(tokens)]
        self.advanced = 0
        self.started: list[str] = []  # requests whose Generate began
        self.closed: list[str] = []  # requests whose Generate was closed before its end
        self.gate = DrainGate()
        self.replies: list[int] = []  # events per reply sent

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if request.request_id.startswith("bad"):
            raise ValueError(f"{request.request_id}: no such thing")
        self.started.append(request.request_id)
        done = False
        try:
            for i in range(self.tokens):
                await self.steps[i].wait()
                last = i == self.tokens - 1
                yield decode_pb2.GenerateResponse(token_ids=[100 + i],
                                                  finish_reason="length" if last else "")
            done = True
        finally:
            if not done:
                self.closed.append(request.request_id)

    async def GenerateStreams(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        streams = GenerateStreams(self.Generate, lambda: self.gate.admitting, self.gate.closing)
        async for reply in streams.serve(request_iterator):
            self.replies.append(len(reply.events))
            yield reply

    async def advance(self) -> None:
        """The next step: every open request's next token (all of them woken at once)."""
        self.steps[self.advanced].set()
        self.advanced += 1
        for _ in range(20):  # let the messages travel
            await asyncio.sleep(0.005)



async def _serve(script: Script, shared: bool = True,
                 port: int = 0) -> tuple[grpc.aio.Server, str]:
    """A server of `script`; `shared` false: one that knows Generate alone (a decode worker of
    an earlier version: GenerateStreams is UNIMPLEMENTED there)."""
    def add(server: grpc.aio.Server) -> None:
        if shared:
            decode_pb2_grpc.add_DecodeServicer_to_server(script, server)
            return
        generate = grpc.unary_stream_rpc_method_handler(
            script.Generate, request_deserializer=decode_pb2.GenerateRequest.FromString,
            response_serializer=decode_pb2.GenerateResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "pdserve.v1.Decode", {"Generate": generate}),))

    server, _ = await make_server("pdserve.v1.Decode", add)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _open(shared: GenerateCalls, channel: grpc.aio.Channel, request_id: str,
          timeout_s: float | None = 30.0) -> Any:
    return shared.open(channel, decode_pb2.GenerateRequest(request_id=request_id), timeout_s)


async def _drain(call: Any) -> list[int]:
    tokens = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        tokens += msg.token_ids
    return tokens


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_requests_read_as_their_own_calls_and_a_step_is_one_reply() -> None:
    async def main() -> None:
        script = Script(tokens=3)
        server, address = await _serve(script)
        shared = GenerateCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            calls = [_open(shared, channel, f"r{i}") for i in range(4)]
            readers = [asyncio.create_task(_drain(c)) for c in calls]
            await until(lambda: len(script.started) == 4, "every open on the worker")
            for _ in range(3):
                await script.advance()
            assert [await r for r in readers] == [[100, 101, 102]] * 4
            # one call; the 4 requests' messages of a step, then their ends, in few replies
            assert sum(script.replies) == 4 * 3 + 4 and len(script.replies) <= 3 + 2
            assert await calls[0].read() is grpc.aio.EOF  # ended calls stay ended
            bad = _open(shared, channel, "bad-1")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await bad.read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bad-1: no such thing" in err.value.details()
        await server.stop(0)

    run(main())


def test_cancel_and_deadline_close_the_request_on_the_worker() -> None:
    async def main() -> None:
        script = Script(tokens=5)
        server, address = await _serve(script)
        shared = GenerateCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            kept, cut = _open(shared, channel, "kept"), _open(shared, channel, "cut")
            late = _open(shared, channel, "late", timeout_s=1.0)
            await until(lambda: len(script.started) == 3, "every open on the worker")
            await script.advance()
            assert (await cut.read()).token_ids == [100]
            assert cut.cancel() and not cut.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await late.read()  # its first message came; the second never does in time
                await late.read()
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: sorted(script.closed) == ["cut", "late"], "both closed")
            for _ in range(4):  # its other four steps
                await script.advance()
            assert await _drain(kept) == [100, 101, 102, 103, 104]
        await server.stop(0)

    run(main())


def test_a_dead_worker_fails_every_open_request_unavailable_and_a_new_call_follows() -> None:
    async def main() -> None:
        script = Script(tokens=3)
        server, address = await _serve(script)
        shared = GenerateCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            calls = [_open(shared, channel, f"r{i}") for i in range(3)]
            await until(lambda: len(script.started) == 3, "every open on the worker")
            await server.stop(0)
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await until(lambda: sorted(script.closed) == ["r0", "r1", "r2"],
                        "every request cancelled by the call's end")
            assert not shared._calls  # the failed call (and its channel) are let go
        script2 = Script(tokens=1)  # the worker restarted on the same port
        server2, _ = await _serve(script2, port=int(address.rsplit(":", 1)[1]))
        async with grpc.aio.insecure_channel(address) as channel:
            call = _open(shared, channel, "again")
            await until(lambda: script2.started == ["again"], "the open on the new worker")
            await script2.advance()
            assert await _drain(call) == [100]
        await server2.stop(0)

    run(main())


def test_a_draining_worker_refuses_opens_and_ends_the_call_once_idle() -> None:
    async def main() -> None:
        script = Script(tokens=2)
        server, address = await _serve(script)
        shared = GenerateCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            held = _open(shared, channel, "held")
            await until(lambda: script.started == ["held"], "the open on the worker")
            script.gate.close()
            refused = _open(shared, channel, "refused")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refused.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await script.advance()
            await script.advance()
            assert await _drain(held) == [100, 101]  # the request held goes on to its end
            # the worker ended the call: the next request opens anew
            await until(lambda: not shared._calls, "the call ended")
        await server.stop(0)

    run(main())


def test_a_worker_without_the_call_gets_a_generate_per_request() -> None:
    async def main() -> None:
        script = Script(tokens=2)
        server, address = await _serve(script, shared=False)
        shared = GenerateCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            calls = [_open(shared, channel, f"r{i}") for i in range(2)]
            readers = [asyncio.create_task(_drain(c)) for c in calls]
            await until(lambda: len(script.started) == 2, "both Generate calls on the worker")
            await script.advance()
            await script.advance()
            assert [await r for r in readers] == [[100, 101]] * 2
            assert channel in shared._unsupported
        await server.stop(0)

    run(main())


def test_a_backlog_leaves_in_replies_of_at_most_max_events(monkeypatch) -> None:
    import decode_svc.generate_streams as served

    monkeypatch.setattr(served, "MAX_EVENTS", 3)

    async def main() -> None:
        script = Script(tokens=2)
        server, address = await _serve(script)
        shared = GenerateCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            calls = [_open(shared, channel, f"r{i}") for i in range(5)]
            await until(lambda: len(script.started) == 5, "every open on the worker")
            await script.advance()
            await script.advance()
            assert [await _drain(c) for c in calls] == [[100, 101]] * 5
        await server.stop(0)
        assert max(script.replies) == 3 and sum(script.replies) == 5 * 2 + 5

    run(main())
