"""Turn a `SchedulerOutput` into the flat tensors one forward pass reads.

Sequences are laid out prefills first, then decodes (see `engine.attention.metadata`). Built with
Python lists, packed into one int64 and one int32 buffer, and moved to the device in two copies;
the step's tensors are views of those two.

With asynchronous scheduling a decode's input token may still be on its way (sampled by the step
in flight, not appended yet): its id is read on the device from that step's sampled tokens,
`prev_tokens[prev_rows[request_id]]`, so the host never waits for it.

With tensor parallelism rank 0 packs the step (`pack_step`) and sends the `HostStep` to the
other ranks (engine/distributed/step_channel.py); every rank turns it into its device tensors
(`step_tensors`), reading pending tokens from its own copy of the previous step's samples.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.host_copy import to_device
from engine.request import Request
from engine.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # the scheduled requests in batch order
    # [N] int64: index into T of the last token of each sampling seq (and of its drafts, if any)
    sample_rows: torch.Tensor
    sampling: list[ScheduledRequest]  # the N sequences that sample, in row order


@dataclass
class HostStep:
    """One step's inputs as two flat host buffers and the sizes that cut them into parts, each
    part starting on a 16-byte boundary (see `_pack`):

        longs (int64): input_ids [T] | positions [T] | slots [T] | sample_rows [N] |
                       late_dst [L] | late_src [L]
        ints  (int32): query_start [S+1] | seq_lens [S] | block_tables [S * max_blocks]
                       [| lora_slots [T]: each token's LoRA adapter slot, when `has_lora`]
    """

    longs: array
    ints: array
    num_prefills: int
    num_seqs: int  # S
    num_tokens: int  # T
    num_samples: int  # N
    num_late: int  # L: decode inputs read from the previous step's samples on the device
    max_blocks: int
    has_lora: bool = False

    def long_sizes(self) -> list[int]:
        t, n, late = self.num_tokens, self.num_samples, self.num_late
        return [t, t, t, n, late, late]

    def int_sizes(self) -> list[int]:
        s = self.num_seqs
        return [s + 1, s, s * self.max_blocks] + ([self.num_tokens] if self.has_lora else [])


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] int64
    lora_slots: torch.Tensor | None = None  # [T] int32: each token's adapter slot (-1: none)


@dataclass
class PendingTokens:
    """The step in flight's sampled tokens, still on the device: row i of `token_ids` [N] is the
    token of request `rows`' key whose value is i."""

    token_ids: torch.Tensor
    rows: dict[str, int]


def order_for_batch(out: SchedulerOutput) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """The batch's order: prefills (more than one new token) first, then decodes, each group in
    schedule order."""
    prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
    decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
    return prefills, decodes


def build_model_input(
    out: SchedulerOutput, block_size: int, device: torch.device,
    pending: PendingTokens | None = None,
) -> ModelInput:
    host, order = pack_step(out, block_size, pending)
    t = step_tensors(host, block_size, device, pending.token_ids if pending else None)
    return ModelInput(
        input_ids=t.input_ids, positions=t.positions, meta=t.meta, order=order,
        sample_rows=t.sample_rows, sampling=[s for s in order if s.samples],
    )


class HostBlockTables:
    """Each running request's block table as an int32 array, rebuilt only when the block
    manager changed it (`Request.block_table_version`): a step then copies each row with one
    memcpy instead of converting every entry from a Python int. A request's table changes once
    every block_size decode steps; converting them all, every step, took ~0.9 ms of a decode
    step of 256 requests of ~30 blocks on the H100's host (py-spy). `forget` a request once
    finished."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[list[int], int, array]] = {}

    def row(self, req: Request) -> array:
        entry = self._rows.get(req.request_id)
        ids, version = req.block_ids, req.block_table_version
        if entry is None or entry[0] is not ids or entry[1] != version:  # (a list of another
            # request of that id fails the first test)
            entry = self._rows[req.request_id] = (ids, version, array("i", ids))
        return entry[2]

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)


def pack_step(
    out: SchedulerOutput, block_size: int, pending: PendingTokens | None = None,
    lora_slots: Callable[[list[ScheduledRequest]], list[int] | None] | None = None,
    tables: HostBlockTables | None = None,
) -> tuple[HostStep, list[ScheduledRequest]]:
    """The step's inputs in host buffers, and the scheduled requests in batch order.
    `lora_slots(order)`: each token's LoRA slot for requests in that order (None: no adapter).
    `tables`: the requests' block tables kept as arrays across steps (None: converted now)."""
    prefills, decodes = order_for_batch(out)
    order = prefills + decodes
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] | np.ndarray = []  # the decodes'; the prompt chunks' come first
    prefill_slots: list[np.ndarray] = []
    query_start = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    late_dst: list[int] = []  # input rows whose token is pending ...
    late_src: list[int] = []  # ... and its row in `pending.token_ids`
    for s in prefills:  # prompt chunks, and decodes with draft tokens (speculative decoding)
        req, start = s.request, s.start
        end = start + s.num_new_tokens
        input_ids += req.token_ids_slice(start, end - len(s.spec_token_ids))
        input_ids += s.spec_token_ids
        positions += range(start, end)
        prefill_slots.append(chunk_slots(req.block_ids, start, end, block_size))
        query_start.append(query_start[-1] + s.num_new_tokens)
        seq_lens.append(end)
        if s.spec_token_ids:  # the rows of the last token and of the drafts
            sample_rows += range(query_start[-1] - 1 - len(s.spec_token_ids), query_start[-1])
        elif s.samples:
            sample_rows.append(query_start[-1] - 1)
    # Decodes, one token each: most of the batch, most steps; built a column at a time.
    first = len(input_ids)
    reqs = [s.request for s in decodes]
    starts = [s.start for s in decodes]
    positions += starts
    seq_lens += [p + 1 for p in starts]
    query_start += range(first + 1, first + 1 + len(decodes))
    slots += [r.block_ids[p // block_size] * block_size + p % block_size
              for r, p in zip(reqs, starts)]
    sample_rows += [first + i for i, s in enumerate(decodes) if s.samples]
    for r, p in zip(reqs, starts):
        prompt, output = r.prompt_token_ids, r.output_token_ids
        if p < len(prompt):
            input_ids.append(prompt[p])
        elif p - len(prompt) < len(output):
            input_ids.append(output[p - len(prompt)])
        else:  # sampled by the step in flight: read on the device
            assert pending is not None, "a pending input token needs the step in flight"
            late_dst.append(len(input_ids))
            late_src.append(pending.rows[r.request_id])
            input_ids.append(0)
    if prefill_slots:
        slots = np.concatenate([*prefill_slots, np.array(slots, dtype=np.int64)])
    token_loras = None if lora_slots is None else lora_slots(order)
    ints = _pack("i", [query_start, seq_lens])
    rows = [tables.row(s.request) if tables is not None else array("i", s.request.block_ids)
            for s in order]
    # Rows of the block table padded to a multiple of 4 entries, so every row starts 16-byte
    # aligned (see `_pack`).
    max_blocks = -(-max(map(len, rows)) // 4) * 4
    _extend_tables(ints, rows, max_blocks)
    if token_loras is not None:
        ints = _pack("i", [token_loras], ints)
    host = HostStep(
        longs=_pack("q", [input_ids, positions, slots, sample_rows, late_dst, late_src]),
        ints=ints,
        num_prefills=len(prefills),
        num_seqs=len(order), num_tokens=len(input_ids), num_samples=len(sample_rows),
        num_late=len(late_dst), max_blocks=max_blocks, has_lora=token_loras is not None,
    )
    return host, order


def chunk_slots(block_ids: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """The cache slot of each position p in [start, end), block_ids[p // block_size] *
    block_size + p % block_size, as int64; in numpy, since a prompt chunk has thousands of
    positions (a Python loop over them took ~1 ms of a 9k-token step's packing)."""
    first = start // block_size
    blocks = np.asarray(block_ids[first:(end - 1) // block_size + 1], dtype=np.int64)
    positions = np.arange(start, end, dtype=np.int64)
    return blocks[positions // block_size - first] * block_size + positions % block_size


def step_tensors(
    host: HostStep, block_size: int, device: torch.device,
    pending_ids: torch.Tensor | None = None,  # [M] int64: the previous step's samples
) -> StepTensors:
    """The step's device tensors: two host-to-device copies (one per dtype) instead of one per
    tensor, since on CUDA each copy from pageable memory is a synchronous transfer of its own;
    every tensor is a view of one of the two."""
    longs = to_device(host.longs, torch.int64, device)
    ints = to_device(host.ints, torch.int32, device)
    ids_t, pos_t, slots_t, rows_t, dst_t, src_t = _views(longs, host.long_sizes(), 2)
    qstart_t, lens_t, tables_t, *lora_t = _views(ints, host.int_sizes(), 4)
    if host.num_late:
        assert pending_ids is not None, "a pending input token needs the step in flight"
        run = _late_run(host)
        if run is not None:  # one slice copy instead of a gather and a scatter
            dst, src, n = run
            ids_t[dst:dst + n].copy_(pending_ids[src:src + n])
        else:
            ids_t.index_copy_(0, dst_t, pending_ids[src_t])
    s, p = host.num_seqs, host.num_prefills
    (qa, qb), (la, lb) = _bounds(host.int_sizes(), 4)[:2]
    query_start = host.ints[qa:qb].tolist()
    seq_lens = host.ints[la:lb].tolist()
    meta = AttentionMetadata(
        num_prefills=p,
        num_prefill_tokens=query_start[p],
        num_decodes=s - p,
        slot_mapping=slots_t,
        query_start_loc=qstart_t,
        seq_lens=lens_t,
        block_tables=tables_t.view(s, host.max_blocks),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return StepTensors(input_ids=ids_t, positions=pos_t, meta=meta, sample_rows=rows_t,
                       lora_slots=lora_t[0] if lora_t else None)


def _late_run(host: HostStep) -> tuple[int, int, int] | None:
    """(first input row, first row of the previous samples, count) when the late inputs are one
    run on both sides: the usual decode step, the same requests in the same order as the step
    before. None otherwise. Read from the host buffers, so every tensor-parallel rank agrees."""
    (da, db), (sa, sb) = _bounds(host.long_sizes(), 2)[4:6]
    dst, src = host.longs[da:db], host.longs[sa:sb]
    n = len(dst)
    if dst[-1] - dst[0] != n - 1:  # rows are increasing: contiguous iff they span n
        return None
    if src != array("q", range(src[0], src[0] + n)):
        return None
    return dst[0], src[0], n


def _pack(typecode: str, parts: list, buf: array | None = None) -> array:
    """`parts` (lists of ints or int arrays) one after another (after what `buf` holds), each
    starting on a 16-byte boundary.

    Triton specialises a kernel on whether each pointer argument is 16-byte aligned: views at
    offsets that change from step to step would compile new variants of a kernel mid-serving
    (about a second each), the first time a new combination comes up. array.array converts
    Python ints about 2.5x faster than torch.tensor.
    """
    buf = array(typecode) if buf is None else buf
    per_16 = 16 // buf.itemsize
    for part in parts:
        if isinstance(part, np.ndarray):
            buf.frombytes(part.astype(buf.typecode, copy=False).tobytes())
        else:  # converted first: array(typecode, list) runs 2x faster than extend(list)
            buf.extend(array(buf.typecode, part))
        buf.extend(_ZEROS[:-len(buf) % per_16])
    return buf


def _extend_tables(buf: array, rows: list[array], width: int) -> None:
    """Append the block tables as rows of `width` entries, zero-padded (a multiple of 4: each
    row starts 16-byte aligned), each row one memcpy."""
    assert len(buf) % 4 == 0 and width % 4 == 0
    start = len(buf)
    buf.frombytes(bytes(buf.itemsize * width * len(rows)))
    for i, row in enumerate(rows):
        at = start + i * width
        buf[at:at + len(row)] = row


_ZEROS = [0] * 16


def _bounds(sizes: list[int], per_16: int) -> list[tuple[int, int]]:
    """Where each part of `_pack`'s buffer lies."""
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n + (-n % per_16)
    return bounds


def packed_length(sizes: list[int], per_16: int) -> int:
    """Length of `_pack`'s buffer for parts of these sizes."""
    return sum(n + (-n % per_16) for n in sizes)


def _views(packed: torch.Tensor, sizes: list[int], per_16: int) -> list[torch.Tensor]:
    return [packed[a:b] for a, b in _bounds(sizes, per_16)]
