"""Ports for local services come from below the kernel's ephemeral range, free, and never twice."""

from __future__ import annotations

import itertools
import socket

import pytest

from pdserve import ports


def test_ports_are_free_below_the_ephemeral_range_and_distinct():
    low = ports.ephemeral_low()
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST <= p < low for p in picked)
    for p in picked[:20]:  # each one can be bound by a server now
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            s.listen()


def test_a_port_someone_listens_on_is_not_free():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not ports.is_free(port)
    assert ports.is_free(port)  # closed without a connection: no TIME_WAIT holds it


def test_a_busy_port_is_skipped(monkeypatch):
    with socket.socket() as server, socket.socket() as spare:
        server.bind(("127.0.0.1", 0))
        server.listen()
        spare.bind(("127.0.0.1", 0))
        busy, free = server.getsockname()[1], spare.getsockname()[1]
        spare.close()
        draws = itertools.chain([busy, busy], itertools.repeat(free))
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
        monkeypatch.setattr(ports, "_given", set())
        assert ports.free_port() == free  # the busy port was drawn twice and skipped
        with pytest.raises(RuntimeError, match="no free TCP port"):
            ports.free_port()  # it is handed out once: nothing else is ever drawn


def test_a_reserved_port_is_never_drawn(monkeypatch):
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        taken = spare.getsockname()[1]
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        free = spare.getsockname()[1]
    monkeypatch.setattr(ports, "_given", set())
    ports.reserve(taken)  # free now, bound later by another service
    draws = itertools.chain([taken, taken], itertools.repeat(free))
    monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
    assert ports.free_port() == free
