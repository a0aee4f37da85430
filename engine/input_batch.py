"""Turn a `SchedulerOutput` into the flat tensors one forward pass reads.

Sequences are laid out prefills first, then decodes (see `engine.attention.metadata`). Built with
Python lists, packed into one int64 and one int32 buffer, and moved to the device in two copies;
the step's tensors are views of those two.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.host_copy import to_device
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # the scheduled requests in batch order
    sample_rows: torch.Tensor  # [N] int64: index into T of the last token of each sampling seq
    sampling: list[ScheduledRequest]  # the N sequences that sample, in row order


def order_for_batch(out: SchedulerOutput) -> list[ScheduledRequest]:
    """Prefills (more than one new token) first, then decodes, each group in schedule order."""
    prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
    decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
    return prefills + decodes


def build_model_input(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelInput:
    order = order_for_batch(out)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    for s in order:
        req, start = s.request, s.request.num_computed_tokens
        end = start + s.num_new_tokens
        table = req.block_ids
        if s.num_new_tokens == 1:  # decodes: most of the batch, most steps
            input_ids.append(req.token_ids_slice(start, end)[0])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids += req.token_ids_slice(start, end)
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(start, end)]
        query_start.append(query_start[-1] + s.num_new_tokens)
        seq_lens.append(end)
        if s.samples:
            sample_rows.append(query_start[-1] - 1)
    max_blocks = max(len(s.request.block_ids) for s in order)
    tables = [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in order]
    num_prefills = sum(1 for s in order if s.num_new_tokens > 1)

    # Two host-to-device copies per step (one per dtype) instead of one per tensor: on CUDA each
    # copy from pageable memory is a synchronous transfer of its own. array.array converts
    # Python ints about 2.5x faster than torch.tensor(list).
    longs = array("q", input_ids)
    for part in (positions, slots, sample_rows):
        longs.extend(part)
    ints = array("i", query_start)
    ints.extend(seq_lens)
    for row in tables:
        ints.extend(row)
    longs = to_device(longs, torch.int64, device)
    ints = to_device(ints, torch.int32, device)
    t, s = len(input_ids), len(order)
    meta = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=query_start[num_prefills],
        num_decodes=s - num_prefills,
        slot_mapping=longs[2 * t : 3 * t],
        query_start_loc=ints[: s + 1],
        seq_lens=ints[s + 1 : 2 * s + 1],
        block_tables=ints[2 * s + 1 :].view(s, max_blocks),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return ModelInput(
        input_ids=longs[:t],
        positions=longs[t : 2 * t],
        meta=meta,
        order=order,
        sample_rows=longs[3 * t :],
        sampling=[s for s in order if s.samples],
    )
