"""Graceful stops and restarts (issue 7, "Worker faults"): a worker's drain on SIGTERM (leave the
registry, admit a moment longer, refuse new requests, finish the held ones), a worker restarted
on another port taking traffic through the same gateway, and the gateway draining its streams."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cluster import run_cluster
from worker_procs import REPO, Proc, spawn, spawn_worker, stop_all, wait_serving

from pdserve.cluster.drain import DrainGate, drain, pause_for
from pdserve.cluster.grpc_server import make_server
from pdserve.ports import free_port

GENERATE = "/pdserve.v1.Decode/Generate"
PUSH_KV = "/pdserve.v1.Decode/PushKV"


# ---- the drain, on an in-process server ------------------------------------------------------
def _fake_decode(release: asyncio.Event) -> grpc.GenericRpcHandler:
    """Generate yields b"first", waits for `release`, yields b"last"; PushKV answers b"ok"."""

    async def generate(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        await release.wait()
        yield b"last"

    async def push(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"ok"

    return grpc.method_handlers_generic_handler("pdserve.v1.Decode", {
        "Generate": grpc.unary_stream_rpc_method_handler(generate),
        "PushKV": grpc.unary_unary_rpc_method_handler(push),
    })


async def _rest(call: grpc.aio.UnaryStreamCall) -> list[bytes]:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def test_pause_is_a_second_or_a_quarter_of_the_drain_timeout():
    assert pause_for(30.0) == 1.0
    assert pause_for(2.0) == 0.5


async def test_drain_admits_during_the_pause_then_refuses_and_finishes_what_it_holds():
    release = asyncio.Event()
    gate = DrainGate()
    server, _ = await make_server(
        "pdserve.v1.Decode", lambda s: s.add_generic_rpc_handlers((_fake_decode(release),)),
        [gate])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    events: list[object] = []

    async def deregister() -> None:
        events.append("deregister")

    async def on_stop() -> None:
        events.append(("on_stop", gate.in_flight))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        generate, push = ch.unary_stream(GENERATE), ch.unary_unary(PUSH_KV)
        held = generate(b"")
        assert await held.read() == b"first"
        stopping = asyncio.create_task(drain(gate, server, 8.0, deregister, on_stop))
        await asyncio.sleep(0.2)  # deregistered, within the 1 s pause
        assert events == ["deregister"] and gate.admitting
        late = generate(b"")  # a gateway that read the registry just before: still admitted
        assert await late.read() == b"first"
        await asyncio.sleep(1.0)  # past the pause: admissions closed
        assert not gate.admitting and gate.in_flight == 2
        refused = generate(b"")
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await refused.read()
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (exc.value.details() or "")
        assert await push(b"") == b"ok"  # a held request's KV still gets in
        assert not stopping.done()  # two streams in flight
        release.set()
        assert await _rest(held) == [b"last"] and await _rest(late) == [b"last"]
        await asyncio.wait_for(stopping, 5.0)
    assert events == ["deregister", ("on_stop", 0)]


async def test_drain_cuts_off_what_outlasts_the_timeout():
    gate = DrainGate()
    server, _ = await make_server(
        "pdserve.v1.Decode",
        lambda s: s.add_generic_rpc_handlers((_fake_decode(asyncio.Event()),)), [gate])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def nothing() -> None:
        pass

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        held = ch.unary_stream(GENERATE)(b"")
        assert await held.read() == b"first"
        t0 = time.monotonic()
        await drain(gate, server, 1.0, nothing, nothing, busy=lambda: True)
        assert time.monotonic() - t0 < 2.5
        with pytest.raises(grpc.aio.AioRpcError):
            await _rest(held)


# ---- real processes --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("graceful")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--dtype", "float32", "--kv-cache-memory",
                     str(16 << 20), "--max-model-len", "512", "--prefill", "1", "--decode", "1",
                     "--log-level", "warning") as c:
        yield c


@pytest.fixture(scope="module")
def spawned():
    procs: list[Proc] = []
    yield procs
    stop_all(procs)


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _restart_on_new_port(argv: list[str]) -> tuple[Proc, str]:
    """The worker of `argv` (as `pdserve up` started it) again, with new gRPC/metrics ports."""
    args, port = argv[1:], free_port()  # argv[0]: the interpreter
    for flag, value in (("--port", port), ("--metrics-port", free_port())):
        args[args.index(flag) + 1] = str(value)
    proc = spawn(f"decode:{port}", args)
    address = f"127.0.0.1:{port}"
    wait_serving(proc, address)
    return proc, address


def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _complete(url: str, max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.mark.slow
def test_a_restarted_decode_worker_rejoins_and_takes_traffic(cluster, spawned):
    """kill -9 the only decode worker; the same flags on another port serve requests through
    the gateway that was never restarted."""
    pid = cluster.pids()["decode-0"]
    argv = _argv(pid)
    assert _complete(cluster.url).status_code == 200
    os.kill(pid, signal.SIGKILL)
    proc, address = _restart_on_new_port(argv)
    spawned.append(proc)
    _until(lambda: [w.address for w in cluster.workers("decode")] == [address], 15.0,
           "the dead worker's entry did not expire / the new one did not register")
    for _ in range(3):
        r = _complete(cluster.url)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8


def _stream(url: str, max_tokens: int) -> Any:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60)


def _read_stream(lines: Iterator[str]) -> tuple[int, str | None, bool]:
    """(chunks, last finish reason, saw [DONE]) of the SSE lines left in a completion stream."""
    chunks, reason, done = 0, None, False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunks += 1
        reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
    return chunks, reason, done


@pytest.mark.slow
def test_sigterm_on_a_decode_worker_finishes_its_stream_then_exits(cluster, spawned):
    """Follows the restart test: the decode worker is the one it started."""
    [decode] = [p for p in spawned if p.popen.poll() is None]
    max_tokens = 400
    with _stream(cluster.url, max_tokens) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None, first
        decode.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, reason, done = _read_stream(lines)
        streamed_s = time.monotonic() - t0
    assert done and reason == "length"
    usage = _complete(cluster.url, 1)  # no decode worker left: 503, retryable
    assert usage.status_code == 503 and usage.headers["retry-after"] == "1"
    assert decode.popen.wait(timeout=20) == 0
    assert cluster.workers("decode") == []
    print(f"stream finished {streamed_s:.2f} s after SIGTERM")


def test_sigterm_on_workers_drains_then_exits_zero(tiny_llama_dir):
    """A prefill and a decode worker on their own (no Redis): SIGTERM both while the decode
    worker streams; the stream ends normally and both processes exit 0, not by the signal."""
    from pdserve import SamplingParams
    from pdserve.cluster.convert import sampling_params_to_pb
    from protos import decode_pb2, decode_pb2_grpc

    ports = {role: free_port() for role in ("prefill", "decode")}
    flags = ["--dtype", "float32", "--num-kv-blocks", "64", "--drain-timeout", "4"]
    procs = {role: spawn_worker(role, tiny_llama_dir, port, *flags)
             for role, port in ports.items()}
    try:
        for role, proc in procs.items():
            wait_serving(proc, f"127.0.0.1:{ports[role]}")
        params = sampling_params_to_pb(SamplingParams(temperature=0, ignore_eos=True), 200)
        with grpc.insecure_channel(f"127.0.0.1:{ports['decode']}") as ch:
            stream = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                request_id="r", prompt_token_ids=list(range(10, 30)), params=params,
                prefill_locally=True), timeout=30)
            tokens = len(next(stream).token_ids)
            for proc in procs.values():
                proc.popen.send_signal(signal.SIGTERM)
            reasons = []
            for msg in stream:
                tokens += len(msg.token_ids)
                reasons.append(msg.finish_reason)
        assert reasons[-1] == "length" and tokens == 200
        for role, proc in procs.items():
            assert proc.popen.wait(timeout=20) == 0, f"{role}:\n{proc.tail()}"
    finally:
        stop_all(list(procs.values()))


# ---- the gateway -----------------------------------------------------------------------------
_SLOW_GATEWAY = """
import asyncio, argparse, sys
sys.path.insert(0, "tests")
from fake_backend import FakeBackend
from gateway.app import build_app
from gateway.backend import TokenDelta
from gateway.server import _serve_app
from engine.model_loader import load_tokenizer, resolve_model

class Slow(FakeBackend):
    async def generate(self, request_id, prompt_token_ids, params):
        for i in range(params.max_tokens):
            await asyncio.sleep(0.05)
            last = i == params.max_tokens - 1
            yield TokenDelta([prompt_token_ids[0]], None, "length" if last else None, None)

args = argparse.Namespace(host="127.0.0.1", port=int(sys.argv[1]), log_level="info",
                          drain_timeout=float(sys.argv[2]), keep_alive_seconds=15.0,
                          reuse_port=False)
app = build_app(Slow(load_tokenizer(resolve_model(None))))
print("starting", flush=True)
asyncio.run(_serve_app(app, args))
print("exited", flush=True)
"""


def test_sigterm_on_the_gateway_drains_an_in_flight_stream():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_GATEWAY, str(port), "30"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _ready(url), 60.0, "the gateway did not start")
        with _stream(url, 40) as r:  # 40 tokens, 50 ms apart: 2 s
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            tokens, reason, done = _read_stream(lines)
        assert done and reason == "length" and tokens >= 30
        assert proc.wait(timeout=20) == 0  # drained, then a clean exit: not killed by SIGTERM
        assert not _ready(url)  # no longer listening
        assert proc.stdout is not None and proc.stdout.read().splitlines()[-1] == "exited"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
