"""Start a real, throw-away redis-server for tests: loopback only, no persistence; optionally
password-protected (`requirepass`) and TLS-only (`rediss://`, the test certificates)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from pdserve.ports import free_port


@dataclass(frozen=True)
class RedisTLS:
    cert: str  # PEM paths: the server's certificate and key, and the CA clients check it with
    key: str
    ca: str


def _answers_ping(port: int, password: str | None = None, tls: RedisTLS | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            s = raw
            if tls is not None:
                context = ssl.create_default_context(cafile=tls.ca)
                s = context.wrap_socket(raw, server_hostname="127.0.0.1")
            replies = s.makefile("rb")
            if password is not None:
                s.sendall(f"AUTH {password}\r\n".encode())
                if not replies.readline().startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return replies.readline().startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def run_redis_server(
    binary: str = "redis-server", startup_s: float = 10.0, password: str | None = None,
    tls: RedisTLS | None = None,
) -> Iterator[str]:
    """Run redis-server on a free 127.0.0.1 port in a temp dir; yield its URL,
    ``redis://127.0.0.1:N/0`` (``redis://:PASSWORD@...`` with a password; ``rediss://...
    ?ssl_ca_certs=CA`` with TLS, which then is the only way in).

    Waits until it answers PING; kills it and removes the dir on exit. Raises RuntimeError if
    the binary is missing or the server does not come up within ``startup_s``.
    """
    path = shutil.which(binary) or (binary if binary.startswith("/") else None)
    if path is None:
        raise RuntimeError(f"{binary} not found on PATH")
    with tempfile.TemporaryDirectory(prefix="pdserve-redis-") as tmp:
        proc, port = _start(path, tmp, startup_s, password, tls)
        auth = f":{quote(password, safe='')}@" if password is not None else ""
        try:
            if tls is None:
                yield f"redis://{auth}127.0.0.1:{port}/0"
            else:
                yield f"rediss://{auth}127.0.0.1:{port}/0?ssl_ca_certs={quote(tls.ca)}"
        finally:
            proc.kill()
            proc.wait(timeout=10)


def _argv(path: str, tmp: str, port: int, password: str | None, tls: RedisTLS | None) -> list[str]:
    cmd = [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", tmp, "--logfile", f"{tmp}/redis.log"]
    if password is not None:
        cmd += ["--requirepass", password]
    if tls is not None:  # TLS only: the plaintext port is closed
        cmd[2] = "0"
        cmd += ["--tls-port", str(port), "--tls-cert-file", tls.cert, "--tls-key-file", tls.key,
                "--tls-ca-cert-file", tls.ca, "--tls-auth-clients", "no"]
    return cmd


def _start(
    path: str, tmp: str, startup_s: float, password: str | None, tls: RedisTLS | None,
    attempts: int = 3,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start the server, retrying on a new port if another process took the free one first."""
    for _ in range(attempts):
        port = free_port()
        cmd = _argv(path, tmp, port, password, tls)
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_ready(proc, port, startup_s, password, tls):
            return proc, port
        proc.kill()
        proc.wait(timeout=10)
    log = Path(tmp, "redis.log")
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"{path} did not start after {attempts} tries:\n{tail}")


def _wait_ready(
    proc: subprocess.Popen[bytes], port: int, startup_s: float, password: str | None,
    tls: RedisTLS | None,
) -> bool:
    deadline = time.monotonic() + startup_s
    while not _answers_ping(port, password, tls):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def start_redis_on(port: int, workdir: str, binary: str = "redis-server",
                   startup_s: float = 10.0) -> subprocess.Popen[bytes]:
    """redis-server on 127.0.0.1:`port` (plaintext, no password, no persistence) in `workdir`,
    answering PING, for a test that stops and restarts Redis on one port. The caller stops it.
    Raises RuntimeError if it does not come up within `startup_s`."""
    path = shutil.which(binary) or binary
    proc = subprocess.Popen(_argv(path, workdir, port, None, None), cwd=workdir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not _wait_ready(proc, port, startup_s, None, None):
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"redis-server did not start on port {port}")
    return proc
