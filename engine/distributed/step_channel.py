"""How rank 0 tells the other ranks what to run next, without pickle.

Every message is a fixed header of 8 int64 broadcast on the host group, then the buffers it
announces (engine/input_batch.py `HostStep`: one int64 and one int32 buffer, sizes implied by
the header). The other ranks block in `receive` between steps.

    header = [command, num_prefills, num_seqs, num_tokens, num_samples, num_late, max_blocks, 0]
"""

from __future__ import annotations

from array import array

import torch

from engine.distributed.group import SingleRank
from engine.input_batch import HostStep, packed_length

STEP, STOP = 1, 2
_HEADER = 8


def send_step(group: SingleRank, host: HostStep) -> None:
    header = [STEP, host.num_prefills, host.num_seqs, host.num_tokens, host.num_samples,
              host.num_late, host.max_blocks, 0]
    group.broadcast_host(torch.tensor(header, dtype=torch.int64))
    for buf, dtype in ((host.longs, torch.int64), (host.ints, torch.int32)):
        group.broadcast_host(torch.frombuffer(buf, dtype=dtype))


def send_stop(group: SingleRank) -> None:
    group.broadcast_host(torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64))


def receive(group: SingleRank) -> HostStep | None:
    """The next step from rank 0, or None when told to stop."""
    header = group.broadcast_host(torch.empty(_HEADER, dtype=torch.int64)).tolist()
    command, prefills, seqs, tokens, samples, late, max_blocks, _ = header
    if command == STOP:
        return None
    if command != STEP:
        raise RuntimeError(f"unknown command {command} from tensor-parallel rank 0")
    host = HostStep(array("q"), array("i"), prefills, seqs, tokens, samples, late, max_blocks)
    longs = torch.empty(packed_length(host.long_sizes(), 2), dtype=torch.int64)
    ints = torch.empty(packed_length(host.int_sizes(), 4), dtype=torch.int32)
    host.longs = array("q", group.broadcast_host(longs).numpy().tobytes())
    host.ints = array("i", group.broadcast_host(ints).numpy().tobytes())
    return host
