"""CUDA graphs for speculative verification steps: each verified token replayed as a decode row.

NOTE: why a verification step fits a decode graph. A request verifying k' drafts has q = k' + 1
query tokens (its last token, then the drafts) over a paged prefix; token t, at position p, sees
keys 0..p causally. A decode row whose context length is p + 1, over the same block table, sees
exactly those keys. So a step whose chunks are all short (at most k + 1 tokens: verifications,
plain decodes, a prompt's short last chunk) is rewritten as a decode-only step with one row per
token, and replayed from the decode graph of the smallest captured size >= T
(engine/cuda_graphs.py):

    request     r0: last d0 d1 d2    r1: last d0    r2: last   | padding
    position         40  41 42 43         90  91          17   |
    row               0   1  2  3          4   5           6   |  7 ...
    seq_len          41  42 43 44         91  92          18   |  0      (= position + 1)
    block table      r0  r0 r0 r0         r1  r1          r2   |  stale, never read
    slot             as in the step (each token writes its own K/V)          -1: no write

Nothing is padded per request: a request the policy gave fewer drafts, or none, is fewer rows,
and the step is padded at its end as decode steps are (slot -1 stores nothing; length 0 reads
nothing and yields zeros; those rows are never sampled). Every other op of the forward is per
token, so a row's output is the chunked forward's output for that token (equal up to the
attention kernels' summation order: the decode kernel instead of the prefill kernel, which on the
Triton backend also reads every key from the cache, an fp8 one included).

Sizes: the decode ladder (1, 2, 4, 8, 16, 24, ...) plus B * (k + 1) for each of its sizes B, so
a step where every one of B requests verifies k drafts fills its graph; most of them are already
on the ladder (every 8 above 8). A row reads its request's whole context, k + 1 reads per
request where the chunked kernel reads once; the rows of a request are neighbouring programs of
the decode kernel's grid and run together, so the repeats should mostly hit L2 (not measured
apart: docs/benchmarks.md has the whole forward's time per k).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from engine.lora.layers import LoRAContext

MAX_GRAPH_ROWS = 512  # the largest graph: decodes, or verified tokens


def verify_sizes(max_batch: int, k: int, cap: int) -> list[int]:
    """B * (k + 1) for every size B of the decode ladder of `max_batch`, those <= `cap`."""
    return sorted({b * (k + 1) for b in capture_sizes(max_batch) if b * (k + 1) <= cap})


def graph_query_len(config: EngineConfig) -> int:
    """The longest chunk a step may have and replay from a graph: 1 + k with speculation."""
    spec = config.speculative
    if spec is None or config.role == "prefill":
        return 1
    return 1 + (spec.num_speculative_tokens or 0)


def capture_graphs(
    config: EngineConfig, model: torch.nn.Module, kv_caches: list[torch.Tensor],
    device: torch.device, lora: LoRAContext | None = None,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> DecodeGraphs:
    """`model`'s decode graphs, captured: the ladder of min(max_num_seqs, MAX_GRAPH_ROWS), and
    with speculation the verification sizes beside it; with `head`, argmax graphs
    (engine/cuda_graphs.py)."""
    sched = config.scheduler
    max_batch = min(sched.max_num_seqs, MAX_GRAPH_ROWS)
    extra = verify_sizes(max_batch, graph_query_len(config) - 1, MAX_GRAPH_ROWS)
    graphs = DecodeGraphs(model, kv_caches, max_batch, sched.max_model_len,
                          config.cache.block_size, device, lora=lora, extra_sizes=extra,
                          head=head)
    graphs.capture()
    return graphs


def fits_as_decode_rows(meta: AttentionMetadata, max_query_len: int, max_rows: int) -> bool:
    """Whether every chunk of the step has at most `max_query_len` tokens, and the step at most
    `max_rows` tokens (host lists only: no device work)."""
    starts = meta.query_start_loc_cpu
    if starts[-1] > max_rows:
        return False
    return all(starts[i + 1] - starts[i] <= max_query_len for i in range(meta.num_prefills))


def row_keys(meta: AttentionMetadata) -> int:
    """The keys a step's attention reads as decode rows: a chunk of q tokens ending at length
    L has rows of lengths L - q + 1 .. L, q * L - q (q - 1) / 2 keys (host lists only)."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    total = 0
    for i in range(meta.num_seqs):
        q = starts[i + 1] - starts[i]
        total += q * lens[i] - q * (q - 1) // 2
    return total


def prefill_rows_fit(meta: AttentionMetadata, max_rows: int, max_keys: int) -> bool:
    """Whether a step with prompts' chunks runs as decode rows from a graph (see the NOTE):
    its tokens fill at most the largest graph, and its rows read at most `max_keys` keys.

    NOTE: why. Run eagerly, a step with a prompt in it launches every layer's kernels one by
    one: on an H100 a prompt of 128 tokens took 6.6-13.5 ms of which the GPU was busy 1.4 ms,
    512 tokens 7.2-14.9 ms against 2.25 (the 1B shape, `python -m pdserve.bench.prefill_step`,
    two machines, 2026-12-06); that host time is the time to first token of a lightly loaded
    server. As rows it is one replay: 2.40 ms for 128 tokens, 4.31 for 512 (`--row-keys
    0,262144`, the same run as the 6.6 and 7.2). A row re-reads its sequence's keys where the
    chunked kernel reads them once per block of queries (the GPU's 2.25 ms became 3.08 at 512
    tokens), so the rows' keys are capped (`DecodeGraphs.row_keys_max`, 2^18: a 512-token
    prompt from scratch reads 131k keys, ~270 MB a layer of the 1B shape, from a working set
    of 1 MiB that L2 holds)."""
    if max_keys <= 0 or meta.query_start_loc_cpu[-1] > max_rows:
        return False
    return row_keys(meta) <= max_keys


def as_decode_rows(positions: torch.Tensor, meta: AttentionMetadata) -> AttentionMetadata:
    """The step as a decode-only step with one row per token (see the NOTE): row t has context
    length positions[t] + 1 and its sequence's block table. `positions` [T] int64 are the
    step's token positions. No host sync; `meta` is not modified."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    num_tokens = starts[-1]
    row_lens = [lens[i] - (starts[i + 1] - t) + 1
                for i in range(meta.num_seqs) for t in range(starts[i], starts[i + 1])]
    tables = meta.block_tables.repeat_interleave(
        meta.query_start_loc.diff(), dim=0, output_size=num_tokens)  # [T, max_blocks]
    return AttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=num_tokens,
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=positions.device),
        seq_lens=(positions + 1).to(torch.int32),
        block_tables=tables,
        query_start_loc_cpu=list(range(num_tokens + 1)),
        seq_lens_cpu=row_lens,
        max_seq_len=meta.max_seq_len,
        block_size=meta.block_size,
    )


def forward_step(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    backend: AttentionBackend,
    graphs: DecodeGraphs | None,
    input_ids: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    meta: AttentionMetadata,
    max_query_len: int = 1,
    on_layer: Callable[[int], None] | None = None,
) -> torch.Tensor:  # [T, hidden]
    """One step's forward: replayed from `graphs` when one fits (a decode-only step; as decode
    rows, a step of chunks of at most `max_query_len` tokens, or one with prompts' chunks that
    `prefill_rows_fit`), else eagerly (with `on_layer` called per layer). A replayed step calls
    no `on_layer`: its caller's notes of the whole step, after it, stand for every layer
    (engine/kv_progress.py's `StepNotes.end`). The choice rests on `meta` alone, the same on
    every tensor-parallel rank (only rank 0 of a prefill worker passes `on_layer`), so every
    rank replays the same graph or none (their collectives stay in step)."""
    if graphs is not None and graphs.can_run(meta):
        return graphs.run(input_ids, positions, meta)
    if graphs is not None and graphs.ready and (
            (max_query_len > 1 and fits_as_decode_rows(meta, max_query_len, graphs.max_batch))
            or prefill_rows_fit(meta, graphs.max_batch, graphs.row_keys_max)):
        graphs.row_replays += 1
        return graphs.run(input_ids, positions, as_decode_rows(positions, meta))
    backend.prepare(meta)
    return model(input_ids, positions, kv_caches, meta, on_layer)
