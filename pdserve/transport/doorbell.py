"""The commit doorbell: a data-plane push's commit, rung on the decode worker's host without
gRPC, read by the decode engine's own thread between steps.

NOTE: why. Over a one-sided data plane (cuda_ipc, nixl) the KV is in the decode worker's pool
once the prefill worker's last write returns; what is left of the handover is the commit. As a
gRPC message it took 0.50 ms to reach the decode engine on an idle H200 host and 0.93 ms with 4
requests decoding (the worker's event loop waits for the GIL behind the engine thread and the
Generate streams), and it then waited for the step boundary after that. So the prefill worker
also sends the commit as one Unix datagram to the address the decode worker published in
DescribeKV (`KVPoolInfo.doorbell`), and the decode engine thread drains the socket itself before
each step's commands (`AsyncLLMEngine.between_steps`): the request joins the next step, whatever
the event loop is doing.

gRPC stays the control plane: the commit message still follows on the push's stream, still
answers the push (bytes, errors), and finds the request committed (decode_svc/receiver.py:
`ring`). A datagram lost (a full socket buffer, peers in different network namespaces, a
request asking for logprobs: its first token's logprobs are not in the record) costs nothing:
the gRPC commit commits as before. A record is acted on only for the push that is the request's
current one and for this worker's pool id (the pool id is known only to peers that described
the pool over gRPC).

    record = b"PDKV" | push id u32 | first token id u32 | pool id (ascii) | 0 | request id (utf-8)

The address is in Linux's abstract socket namespace (no file to clean up, gone with the
process) and per network namespace: pods on one node in their own namespaces do not reach each
other's doorbell, and their pushes commit over gRPC alone.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import uuid
from collections.abc import Callable
from typing import NamedTuple

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
_HEAD = struct.Struct("<4sII")
MAX_RECORD = 4096  # a request id is at most a few hundred bytes


class Ring(NamedTuple):
    """One doorbell record: the push `push_id` of `request_id` wrote every block and sampled
    `first_token_id`."""

    request_id: str
    push_id: int
    first_token_id: int
    pool_id: str


def encode(ring: Ring) -> bytes:
    return (_HEAD.pack(MAGIC, ring.push_id, ring.first_token_id) + ring.pool_id.encode("ascii")
            + b"\0" + ring.request_id.encode("utf-8"))


def decode(data: bytes) -> Ring | None:
    """The record in `data`; None if it is not one."""
    if len(data) < _HEAD.size or not data.startswith(MAGIC):
        return None
    _, push_id, token = _HEAD.unpack_from(data)
    pool_id, sep, request_id = data[_HEAD.size:].partition(b"\0")
    if not sep or not request_id:
        return None
    try:
        return Ring(request_id.decode("utf-8"), push_id, token, pool_id.decode("ascii"))
    except UnicodeDecodeError:
        return None


def _address(name: str) -> bytes:
    return b"\0" + name.encode("ascii")


class DoorbellListener:
    """The decode worker's doorbell: a non-blocking datagram socket `drain`ed by the engine
    thread. Records for another pool id or malformed ones are dropped (logged).

    A busy engine thread drains it before every step; an idle one blocks on its commands, so a
    waker thread (`wake_on_ring`) wakes it when a record waits undrained."""

    def __init__(self, pool_id: str):
        self.pool_id = pool_id
        self.name = f"pdserve-kv-doorbell-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(_address(self.name))
        self._sock.setblocking(False)
        self._drained = threading.Event()
        self._closed = False

    def wake_on_ring(self, wake: Callable[[], None]) -> None:
        """Call `wake()` from a thread of its own whenever a record waits, then wait until a
        `drain` took it (so a record waiting for a busy engine's next step costs one call)."""
        threading.Thread(target=self._wake_loop, args=(wake,), name="pdserve-kv-doorbell",
                         daemon=True).start()

    def _wake_loop(self, wake: Callable[[], None]) -> None:
        while not self._closed:
            try:
                readable, _, _ = select.select([self._sock], [], [], 1.0)
            except (OSError, ValueError):  # closed meanwhile
                return
            if readable and not self._closed:
                wake()
                self._drained.wait(1.0)
                self._drained.clear()

    def drain(self) -> list[Ring]:
        """Every record waiting now (never blocks)."""
        rings: list[Ring] = []
        while True:
            try:
                data = self._sock.recv(MAX_RECORD)
            except (BlockingIOError, OSError):
                return rings
            self._drained.set()
            ring = decode(data)
            if ring is None or ring.pool_id != self.pool_id:
                logger.warning("KV doorbell: dropped a record that is not for this pool")
                continue
            rings.append(ring)

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class DoorbellSender:
    """The prefill worker's side: one unbound, non-blocking datagram socket for every peer."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def ring(self, name: str, ring: Ring) -> bool:
        """Send `ring` to the doorbell `name`; False if it could not go (no such doorbell here,
        its buffer full): the gRPC commit does the work then."""
        try:
            self._sock.sendto(encode(ring), _address(name))
        except OSError:
            return False
        return True

    def close(self) -> None:
        self._sock.close()
