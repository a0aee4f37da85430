"""Start a real, throw-away redis-server for tests: loopback only, no persistence."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.launcher import free_port


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def run_redis_server(binary: str = "redis-server", startup_s: float = 10.0) -> Iterator[str]:
    """Run redis-server on a free 127.0.0.1 port in a temp dir; yield ``redis://127.0.0.1:N/0``.

    Waits until it answers PING; kills it and removes the dir on exit. Raises RuntimeError if
    the binary is missing or the server does not come up within ``startup_s``.
    """
    path = shutil.which(binary) or (binary if binary.startswith("/") else None)
    if path is None:
        raise RuntimeError(f"{binary} not found on PATH")
    with tempfile.TemporaryDirectory(prefix="pdserve-redis-") as tmp:
        proc, port = _start(path, tmp, startup_s)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait(timeout=10)


def _start(
    path: str, tmp: str, startup_s: float, attempts: int = 3
) -> tuple[subprocess.Popen[bytes], int]:
    """Start the server, retrying on a new port if another process took the free one first."""
    for _ in range(attempts):
        port = free_port()
        cmd = [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", tmp, "--logfile", f"{tmp}/redis.log"]
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_ready(proc, port, startup_s):
            return proc, port
        proc.kill()
        proc.wait(timeout=10)
    log = Path(tmp, "redis.log")
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"{path} did not start after {attempts} tries:\n{tail}")


def _wait_ready(proc: subprocess.Popen[bytes], port: int, startup_s: float) -> bool:
    deadline = time.monotonic() + startup_s
    while not _answers_ping(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
