"""How rank 0 tells the other ranks what to run next, without pickle.

One pipe per rank (a Unix socket). A message is raw bytes: a fixed header of 8 int64, then the
step's two buffers (engine/input_batch.py `HostStep`: int64 then int32 parts, their sizes implied
by the header). A rank blocks on its pipe between steps for as long as rank 0 stays idle (a
collective would time out), and sees rank 0's death as the end of the pipe.

    header = [command, num_prefills, num_seqs, num_tokens, num_samples, num_late, max_blocks, 0]
"""

from __future__ import annotations

from array import array
from multiprocessing.connection import Connection

from engine.input_batch import HostStep, packed_length

STEP, STOP = 1, 2
_HEADER = 8


def send_step(conns: list[Connection], host: HostStep) -> None:
    header = array("q", [STEP, host.num_prefills, host.num_seqs, host.num_tokens,
                         host.num_samples, host.num_late, host.max_blocks, 0])
    message = b"".join((header.tobytes(), host.longs.tobytes(), host.ints.tobytes()))
    for conn in conns:
        conn.send_bytes(message)


def send_stop(conns: list[Connection]) -> None:
    message = array("q", [STOP] + [0] * (_HEADER - 1)).tobytes()
    for conn in conns:
        conn.send_bytes(message)


def receive(conn: Connection) -> HostStep | None:
    """The next step from rank 0, or None when told to stop. EOFError if rank 0 is gone."""
    message = memoryview(conn.recv_bytes())
    header = array("q")
    header.frombytes(message[: 8 * _HEADER])
    command, prefills, seqs, tokens, samples, late, max_blocks, _ = header
    if command == STOP:
        return None
    if command != STEP:
        raise RuntimeError(f"unknown command {command} from tensor-parallel rank 0")
    host = HostStep(array("q"), array("i"), prefills, seqs, tokens, samples, late, max_blocks)
    longs_end = 8 * _HEADER + 8 * packed_length(host.long_sizes(), 2)
    host.longs.frombytes(message[8 * _HEADER:longs_end])
    host.ints.frombytes(message[longs_end:])
    return host
