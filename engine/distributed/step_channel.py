"""How rank 0 tells the other ranks what to run next, without pickle.

One pipe per rank (a Unix socket). A message is raw bytes: a fixed header of 8 int64, then the
step's two buffers (engine/input_batch.py `HostStep`: int64 then int32 parts, their sizes implied
by the header). A rank blocks on its pipe between steps for as long as rank 0 stays idle (a
collective would time out), and sees rank 0's death as the end of the pipe.

    header = [command, num_prefills, num_seqs, num_tokens, num_samples, num_late, max_blocks,
              has_lora]

A LoRA placement (multi-LoRA: rank 0 puts an adapter into a device slot before the step that
needs it) is a header [LORA, slot, 0, ...] and the adapter's LoRARequest fields as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from array import array
from multiprocessing.connection import Connection

from engine.input_batch import HostStep, packed_length
from engine.lora.request import LoRARequest

STEP, STOP, LORA = 1, 2, 3
_HEADER = 8


def send_step(conns: list[Connection], host: HostStep) -> None:
    header = array("q", [STEP, host.num_prefills, host.num_seqs, host.num_tokens,
                         host.num_samples, host.num_late, host.max_blocks, int(host.has_lora)])
    message = b"".join((header.tobytes(), host.longs.tobytes(), host.ints.tobytes()))
    for conn in conns:
        conn.send_bytes(message)


def send_stop(conns: list[Connection]) -> None:
    message = array("q", [STOP] + [0] * (_HEADER - 1)).tobytes()
    for conn in conns:
        conn.send_bytes(message)


def send_lora(conns: list[Connection], slot: int, request: LoRARequest) -> None:
    header = array("q", [LORA, slot] + [0] * (_HEADER - 2))
    body = json.dumps(dataclasses.asdict(request)).encode()
    for conn in conns:
        conn.send_bytes(header.tobytes() + body)


def receive(conn: Connection) -> HostStep | tuple[int, LoRARequest] | None:
    """The next step from rank 0, a LoRA placement (slot, adapter), or None when told to stop.
    EOFError if rank 0 is gone."""
    message = memoryview(conn.recv_bytes())
    header = array("q")
    header.frombytes(message[: 8 * _HEADER])
    command, prefills, seqs, tokens, samples, late, max_blocks, has_lora = header
    if command == STOP:
        return None
    if command == LORA:
        return prefills, LoRARequest(**json.loads(bytes(message[8 * _HEADER:])))
    if command != STEP:
        raise RuntimeError(f"unknown command {command} from tensor-parallel rank 0")
    host = HostStep(array("q"), array("i"), prefills, seqs, tokens, samples, late, max_blocks,
                    bool(has_lora))
    longs_end = 8 * _HEADER + 8 * packed_length(host.long_sizes(), 2)
    host.longs.frombytes(message[8 * _HEADER:longs_end])
    host.ints.frombytes(message[longs_end:])
    return host
