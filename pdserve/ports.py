"""Free TCP ports for services started on this machine (`pdserve up`, tests, benchmarks).

A port is picked in one process and bound seconds later in another (a worker binds after loading
its model). Asking the kernel for port 0 returns a port from the *ephemeral* range, the same range
the kernel hands to every outgoing connection (Redis, gRPC and HTTP clients open many): in that
window a client's connect may take the port, and the service then fails with "Address already in
use". So ports are drawn at random from below the ephemeral range, where the kernel never assigns
a port on its own, checked free by binding them once, and never handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default; macOS and Windows start higher (49152)
LOWEST = 10000  # below it sit well-known and registered service ports (Redis 6379, 8000s, ...)

_given: set[int] = set()
_lock = threading.Lock()


def ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def is_free(port: int, host: str = "0.0.0.0") -> bool:
    """True when nothing listens on (or holds) `port`: binding the wildcard address conflicts
    with a socket bound to any local address."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    low = ephemeral_low()
    if low - LOWEST < 1000:  # an unusual ephemeral range: let the kernel choose, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    with _lock:
        for _ in range(200):
            port = random.randrange(LOWEST, low)
            if port not in _given and is_free(port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free TCP port found in {LOWEST}-{low - 1}")


def reserve(port: int) -> None:
    """Never hand `port` out from this process: one already chosen for a service that binds it
    later (`pdserve up`'s gateway port, picked by its caller: a worker drew the same port before
    the gateway bound it, and failed to bind)."""
    with _lock:
        _given.add(port)
