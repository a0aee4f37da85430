"""Turn a `SchedulerOutput` into the flat tensors one forward pass reads.

Sequences are laid out prefills first, then decodes (see `engine.attention.metadata`). Built with
Python lists, packed into one int64 and one int32 buffer, and moved to the device in two copies;
the step's tensors are views of those two.

With asynchronous scheduling a decode's input token may still be on its way (sampled by the step
in flight, not appended yet): its id is read on the device from that step's sampled tokens,
`prev_tokens[prev_rows[request_id]]`, so the host never waits for it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.host_copy import to_device
from engine.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # the scheduled requests in batch order
    sample_rows: torch.Tensor  # [N] int64: index into T of the last token of each sampling seq
    sampling: list[ScheduledRequest]  # the N sequences that sample, in row order


@dataclass
class PendingTokens:
    """The step in flight's sampled tokens, still on the device: row i of `token_ids` [N] is the
    token of request `rows`' key whose value is i."""

    token_ids: torch.Tensor
    rows: dict[str, int]


def order_for_batch(out: SchedulerOutput) -> list[ScheduledRequest]:
    """Prefills (more than one new token) first, then decodes, each group in schedule order."""
    prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
    decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
    return prefills + decodes


def build_model_input(
    out: SchedulerOutput, block_size: int, device: torch.device,
    pending: PendingTokens | None = None,
) -> ModelInput:
    order = order_for_batch(out)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    late_dst: list[int] = []  # input rows whose token is pending ...
    late_src: list[int] = []  # ... and its row in `pending.token_ids`
    for s in order:
        req, start = s.request, s.start
        end = start + s.num_new_tokens
        table = req.block_ids
        if s.num_new_tokens == 1:  # decodes: most of the batch, most steps
            if start < req.num_tokens:
                input_ids.append(req.token_ids_slice(start, end)[0])
            else:
                assert pending is not None, "a pending input token needs the step in flight"
                late_dst.append(len(input_ids))
                late_src.append(pending.rows[req.request_id])
                input_ids.append(0)
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
    # Rows of the block table padded to a multiple of 4 entries, so every row starts 16-byte
    # aligned (see `_pack`).
    max_blocks = -(-max(len(s.request.block_ids) for s in order) // 4) * 4
    tables = [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in order]
    num_prefills = sum(1 for s in order if s.num_new_tokens > 1)

    # Two host-to-device copies per step (one per dtype) instead of one per tensor: on CUDA each
    # copy from pageable memory is a synchronous transfer of its own.
    longs, (ids_t, pos_t, slots_t, rows_t, dst_t, src_t) = _pack(
        "q", [input_ids, positions, slots, sample_rows, late_dst, late_src], torch.int64, device)
    ints, (qstart_t, lens_t, tables_t) = _pack(
        "i", [query_start, seq_lens, (x for row in tables for x in row)], torch.int32, device)
    if late_dst:
        ids_t.index_copy_(0, dst_t, pending.token_ids[src_t])
    s = len(order)
    meta = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=query_start[num_prefills],
        num_decodes=s - num_prefills,
        slot_mapping=slots_t,
        query_start_loc=qstart_t,
        seq_lens=lens_t,
        block_tables=tables_t.view(s, max_blocks),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return ModelInput(
        input_ids=ids_t,
        positions=pos_t,
        meta=meta,
        order=order,
        sample_rows=rows_t,
        sampling=[s for s in order if s.samples],
    )


def _pack(
    typecode: str, parts: list, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One device tensor holding `parts` one after another, and a view of each part.

    Each part starts on a 16-byte boundary. Triton specialises a kernel on whether each pointer
    argument is 16-byte aligned: views at offsets that change from step to step would compile
    new variants of a kernel mid-serving (about a second each), the first time a new
    combination comes up. array.array converts Python ints about 2.5x faster than torch.tensor.
    """
    buf = array(typecode)
    per_16 = 16 // buf.itemsize
    bounds = []
    for part in parts:
        start = len(buf)
        buf.extend(part)
        bounds.append((start, len(buf)))
        buf.extend([0] * (-len(buf) % per_16))
    packed = to_device(buf, dtype, device)
    return packed, [packed[a:b] for a, b in bounds]
