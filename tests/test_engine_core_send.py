"""EngineCoreClient's commands (engine/core_client.py): a small one goes from the caller's
thread when nothing is queued and the socket has room, any other through the writer thread;
either way in the order sent, and a full socket never blocks the caller."""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import Connection

from engine.core_client import INLINE_SEND_MAX, EngineCoreClient
from engine.core_process import NO_REPLY, CoreFacts


def _client() -> tuple[EngineCoreClient, Connection]:
    mine, theirs = socket.socketpair()
    facts = CoreFacts(model="m", eos_token_ids=(0,), max_model_len=8, vocab_size=8, loras=())
    return EngineCoreClient(Connection(mine.detach()), facts), Connection(theirs.detach())


def test_commands_arrive_in_order_whatever_their_size() -> None:
    client, child = _client()
    big = list(range(2 * INLINE_SEND_MAX))  # pickled: past the inline bound
    sent = [("add", i, (big if i % 3 == 0 else [i],)) for i in range(30)]
    for op, call_id, args in sent:
        client._send(op, call_id, *args)
    assert [child.recv() for _ in sent] == sent
    child.close()


def test_a_full_socket_queues_small_commands_behind_it_without_blocking() -> None:
    client, child = _client()
    big = list(range(64 * INLINE_SEND_MAX))  # ~1 MB pickled: fills the socket's buffers
    client._send("add", 1, big)
    client._send("add", 2, big)
    time.sleep(0.2)  # the writer is blocked in the second write (the child reads nothing)
    start = time.monotonic()
    for call_id in range(3, 13):
        client._send("abort", call_id, f"r{call_id}")
    assert time.monotonic() - start < 0.5  # queued behind the big ones, not written here
    got = [child.recv() for _ in range(12)]
    assert [m[1] for m in got] == list(range(1, 13))
    assert got[-1] == ("abort", 12, ("r12",))
    deadline = time.monotonic() + 5  # the writer counts its last one sent after the write
    while client._queued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client._queued == 0
    client._send("stats", NO_REPLY)  # nothing queued now: goes inline, and arrives
    assert child.recv() == ("stats", NO_REPLY, ())
    child.close()
