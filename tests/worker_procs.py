"""Real worker processes for the tests: `pdserve prefill|decode` on loopback ports, and a fake
decode worker (run this file as a script) that takes a KV push, reports what it read, then
breaks off.

    python tests/worker_procs.py --port P --chunks N --then abort|hang

The fake prints one JSON line per event on stdout ("serving", "header", "data", "breaking") and,
after the header and N data chunks, aborts the PushKV with UNAVAILABLE (`abort`) or blocks
forever in the middle of the stream (`hang`, for the test to SIGKILL it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    """A child process whose stdout lines are read by a thread into a queue."""

    popen: subprocess.Popen
    name: str
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.log.append(line)
            self.lines.put(line)

    def next_line(self, timeout_s: float = 10.0) -> str:
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no output in {timeout_s} s:\n{self.tail()}") from None

    def next_event(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The next JSON line (other output, e.g. logging, is skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.next_line(max(0.0, deadline - time.monotonic()))
            if line.startswith("{"):
                return json.loads(line)

    def tail(self, n: int = 40) -> str:
        return "".join(self.log[-n:])


def stop_all(procs: list[Proc], timeout_s: float = 20.0) -> None:
    """SIGINT to every process at once (a worker drains and exits), then SIGKILL to any still
    running after `timeout_s`."""
    running = [p.popen for p in procs if p.popen.poll() is None]
    for popen in running:
        popen.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for popen in running:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def spawn(name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1, env=None if env is None else {**os.environ, **env},
    )
    return Proc(popen, name)


def spawn_worker(role: str, model: str, port: int, *flags: str,
                 env: dict[str, str] | None = None) -> Proc:
    """`pdserve ROLE --model MODEL --port PORT FLAGS` (not yet ready: see `wait_serving`), with
    `env` over this process's environment."""
    return spawn(f"{role}:{port}", ["-m", "pdserve.cli", role, "--model", model,
                                    "--port", str(port), *flags], env)


def wait_serving(proc: Proc, address: str, timeout_s: float = 120.0) -> None:
    """Until the worker's standard gRPC health check says SERVING; raises if it exits first."""
    from pdserve.cluster.grpc_server import check_health

    deadline = time.monotonic() + timeout_s
    while not asyncio.run(check_health(address, timeout=1.0)):
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} not serving in {timeout_s} s:\n{proc.tail()}")
        time.sleep(0.2)


def spawn_fake_decode(port: int, chunks: int, then: str) -> Proc:
    """The fake decode worker below, serving once it has printed its "serving" event."""
    proc = spawn(f"fake-decode:{port}", [str(Path(__file__).resolve()), "--port", str(port),
                                         "--chunks", str(chunks), "--then", then])
    event = proc.next_event(timeout_s=30.0)
    assert event == {"event": "serving", "port": port}, event
    return proc


# ---- the fake decode worker (this file as a script) -----------------------------------------
def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _fake_servicer(chunks: int, then: str) -> Any:
    from protos import decode_pb2_grpc

    class FakeDecode(decode_pb2_grpc.DecodeServicer):
        def PushKV(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
            header = next(request_iterator).header
            lay = header.layout
            _emit(event="header", request_id=header.request_id, num_tokens=header.num_tokens,
                  num_blocks=header.num_blocks, layout=[lay.num_layers, lay.num_kv_heads,
                                                        lay.head_dim, lay.dtype, lay.block_size])
            for _ in range(chunks):
                d = next(request_iterator).data
                _emit(event="data", range=[d.layer_start, d.layer_end, d.block_start,
                                           d.block_end], nbytes=len(d.data))
            _emit(event="breaking", then=then)
            if then == "hang":
                threading.Event().wait()
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode worker breaks off")

    return FakeDecode()


def _serve_fake(port: int, chunks: int, then: str) -> None:
    from protos import decode_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    decode_pb2_grpc.add_DecodeServicer_to_server(_fake_servicer(chunks, then), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    # SIGINT / SIGTERM (stop_all) stop it at once, whatever it inherited for them and whatever
    # its handlers' threads still wait on: interpreter exit would join those threads
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop(0))
    server.start()
    _emit(event="serving", port=port)
    server.wait_for_termination()
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    parser = argparse.ArgumentParser(description="a fake decode worker that breaks off PushKV")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=1, help="data chunks to read first")
    parser.add_argument("--then", choices=["abort", "hang"], default="abort")
    a = parser.parse_args()
    _serve_fake(a.port, a.chunks, a.then)
