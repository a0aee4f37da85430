"""PrefillStreams: many requests' Prefill and Reserved calls as messages on one call, over real
gRPC (an in-process server whose Prefill is a scripted stand-in; the real prefill worker behind
it is exercised by the cluster tests, whose gateways take the shared call by default).

Each request answers as its own call would: its response, or its status; a Reserved rides the
same call; cancelling the awaiting task, or its deadline, cancels the Prefill on the worker (its
cleanup runs) and nothing more comes for it; the call ending fails every request waiting on it
UNAVAILABLE and the next request opens a new call; a draining worker refuses Prefills, still
answers Reserveds, and ends the call once idle; a worker without the call (an earlier version)
gets a call per request."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from earlier_peer import add_unary_methods
from polling import until

from gateway.prefill_calls import PrefillCalls
from pdserve.cluster.drain import DrainGate
from pdserve.cluster.grpc_server import make_server
from prefill_svc.prefill_streams import PrefillStreams
from protos import prefill_pb2, prefill_pb2_grpc


class Script(prefill_pb2_grpc.PrefillServicer):
    """A prefill servicer whose Prefill answers with first token 100 + the prompt's length once
    the test's `release()` ran, or fails with ValueError for a request id starting with "bad";
    its Reserved answers whether a Prefill of the request has started."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started: list[str] = []  # requests whose Prefill began
        self.closed: list[str] = []  # requests whose Prefill was cancelled before its end
        self.told: list[str] = []  # Reserveds
        self.calls = 0  # PrefillStreams calls served
        self.replies: list[int] = []  # answers per reply sent
        self.gate = DrainGate()

    async def Prefill(self, request: Any, context: Any) -> Any:
        if request.request_id.startswith("bad"):
            raise ValueError(f"{request.request_id}: no such thing")
        self.started.append(request.request_id)
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.closed.append(request.request_id)
            raise
        return prefill_pb2.PrefillResponse(first_token_id=100 + len(request.prompt_token_ids))

    async def Reserved(self, request: Any, context: Any) -> Any:
        self.told.append(request.request_id)
        return prefill_pb2.ReservedResponse(found=request.request_id in self.started)

    async def PrefillStreams(self, request_iterator: Any, context: Any) -> Any:
        self.calls += 1
        streams = PrefillStreams(self.Prefill, self.Reserved, lambda: self.gate.admitting,
                                 self.gate.closing)
        async for reply in streams.serve(request_iterator):
            self.replies.append(len(reply.answers))
            yield reply


async def _serve(script: Script, shared: bool = True,
                 port: int = 0) -> tuple[grpc.aio.Server, str]:
    """A server of `script`; `shared` false: one that knows Prefill and Reserved alone (a
    prefill worker of an earlier version: PrefillStreams is UNIMPLEMENTED there)."""
    def add(server: grpc.aio.Server) -> None:
        if shared:
            prefill_pb2_grpc.add_PrefillServicer_to_server(script, server)
            return
        add_unary_methods(server, "pdserve.v1.Prefill", script, [
            ("Prefill", prefill_pb2.PrefillRequest, prefill_pb2.PrefillResponse),
            ("Reserved", prefill_pb2.ReservedRequest, prefill_pb2.ReservedResponse)])

    server, _ = await make_server("pdserve.v1.Prefill", add)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _prefill(calls: PrefillCalls, channel: grpc.aio.Channel, request_id: str,
             prompt_len: int = 1, timeout_s: float | None = 30.0) -> asyncio.Task:
    request = prefill_pb2.PrefillRequest(request_id=request_id,
                                         prompt_token_ids=list(range(prompt_len)))
    return asyncio.create_task(calls.prefill(channel, request, timeout_s))


def _reserved(calls: PrefillCalls, channel: grpc.aio.Channel, request_id: str) -> Any:
    return calls.reserved(channel, prefill_pb2.ReservedRequest(request_id=request_id), 30.0)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_requests_answer_as_their_own_calls_on_one_call() -> None:
    async def main() -> None:
        script = Script()
        server, address = await _serve(script)
        calls = PrefillCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            asked = [_prefill(calls, channel, f"r{i}", prompt_len=i + 1) for i in range(4)]
            await until(lambda: len(script.started) == 4, "every Prefill on the worker")
            assert (await _reserved(calls, channel, "r2")).found
            assert not (await _reserved(calls, channel, "early")).found
            script.go.set()
            assert [(await a).first_token_id for a in asked] == [101, 102, 103, 104]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _prefill(calls, channel, "bad-1")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bad-1: no such thing" in err.value.details()
            assert (await _prefill(calls, channel, "after", prompt_len=7)).first_token_id == 107
            assert script.told == ["r2", "early"] and script.calls == 1
        await server.stop(0)

    run(main())


def test_cancel_and_deadline_cancel_the_prefill_on_the_worker() -> None:
    async def main() -> None:
        script = Script()
        server, address = await _serve(script)
        calls = PrefillCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            kept, cut = _prefill(calls, channel, "kept"), _prefill(calls, channel, "cut")
            late = _prefill(calls, channel, "late", timeout_s=0.5)
            await until(lambda: len(script.started) == 3, "every Prefill on the worker")
            cut.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await late
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: sorted(script.closed) == ["cut", "late"], "both cancelled there")
            script.go.set()
            assert (await kept).first_token_id == 101
            assert cut.cancelled()
        await server.stop(0)

    run(main())


def test_a_dead_worker_fails_every_waiting_request_unavailable_and_a_new_call_follows() -> None:
    async def main() -> None:
        script = Script()
        server, address = await _serve(script)
        calls = PrefillCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            asked = [_prefill(calls, channel, f"r{i}") for i in range(3)]
            await until(lambda: len(script.started) == 3, "every Prefill on the worker")
            await server.stop(0)
            for a in asked:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await a
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await until(lambda: sorted(script.closed) == ["r0", "r1", "r2"],
                        "every Prefill cancelled by the call's end")
            assert not calls._calls  # the failed call is let go
        script2 = Script()  # the worker restarted on the same port
        script2.go.set()
        server2, _ = await _serve(script2, port=int(address.rsplit(":", 1)[1]))
        async with grpc.aio.insecure_channel(address) as channel:
            assert (await _prefill(calls, channel, "again", prompt_len=2)).first_token_id == 102
        await server2.stop(0)

    run(main())


def test_a_draining_worker_refuses_prefills_answers_reserveds_and_ends_the_call() -> None:
    async def main() -> None:
        script = Script()
        server, address = await _serve(script)
        calls = PrefillCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            held = _prefill(calls, channel, "held")
            await until(lambda: script.started == ["held"], "the Prefill on the worker")
            script.gate.close()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _prefill(calls, channel, "refused")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await _reserved(calls, channel, "held")).found  # told still
            script.go.set()
            assert (await held).first_token_id == 101  # the Prefill held goes on to its end
            await until(lambda: not calls._calls, "the call ended")
        await server.stop(0)

    run(main())


def test_a_worker_without_the_call_gets_a_call_per_request() -> None:
    async def main() -> None:
        script = Script()
        server, address = await _serve(script, shared=False)
        calls = PrefillCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            asked = [_prefill(calls, channel, f"r{i}") for i in range(2)]
            await until(lambda: len(script.started) == 2, "both Prefill calls on the worker")
            assert (await _reserved(calls, channel, "r1")).found
            script.go.set()
            assert [(await a).first_token_id for a in asked] == [101, 101]
            assert channel in calls._unsupported and script.calls == 0
        await server.stop(0)

    run(main())


def test_answers_leave_in_replies_of_bounded_size(monkeypatch) -> None:
    import prefill_svc.prefill_streams as served

    async def main(limit: int) -> list[int]:
        monkeypatch.setattr(served, "MAX_REPLY_BYTES", limit)
        script = Script()
        server, address = await _serve(script)
        calls = PrefillCalls()
        async with grpc.aio.insecure_channel(address) as channel:
            asked = [_prefill(calls, channel, f"r{i}", prompt_len=i + 1) for i in range(4)]
            await until(lambda: len(script.started) == 4, "every Prefill on the worker")
            script.go.set()  # the four answers are ready in one turn of the worker's loop
            assert [(await a).first_token_id for a in asked] == [101, 102, 103, 104]
        await server.stop(0)
        return script.replies

    assert run(main(1)) == [1, 1, 1, 1]  # one answer a reply, however small the limit
    assert run(main(1 << 20)) == [4]
