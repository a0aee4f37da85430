"""CUDA graphs for decode-only steps: the model forward replayed with one launch.

NOTE: why and how. A decode step of a small model is hundreds of short kernels; launched one by
one from Python the GPU idles between them. Each graph is captured once, at start-up, for a
padded batch size from a ladder (1, 2, 4, 8, then every 8 up to the largest), over static input
buffers; a step with n decodes copies its inputs into the buffers' first n rows and replays the
graph of the smallest size >= n. Padding rows have slot -1 (the KV store skips them) and length
0 (attention reads nothing and writes zeros), so they cost no memory traffic and touch no cache.

    buffers  input_ids [B]  positions [B]  slot_mapping [B]  seq_lens [B]  block_tables [B, W]
             lora_slots [B] (multi-LoRA: each row's adapter slot, -1 for none)
             (B = largest size, W = blocks of a max_model_len sequence)

The attention kernels read only these tensors on replay; the decode split count is fixed per
graph at capture (sized for max_model_len).

Greedy steps of a few rows (at most `argmax_max_batch`) replay a second graph of their size that
also computes the logits and their argmax (`run_argmax`; given the model's `head`). Launched
from Python these were ~0.2 ms of a batch-1 step's host time on an H200's host (a GEMV plan's
call and the argmax's two passes: `python -m pdserve.bench.gpu_first_step`, 2026-11-29), a
quarter of the GPU's step of a 4-bit 1B model. The step's tokens are the graph's static output,
read by the next step's inputs and by the host copy, both queued before the next replay.

A step's inputs go into the buffers by one kernel on the GPU (kernels/stage_inputs.py: the rows'
values, the padding rows' slot -1 and length 0), not five to seven copies and fills;
PDSERVE_STAGE_KERNEL=0 copies them one by one (comparisons).

Steps with more tokens than the largest graph run eagerly. Others with prompts' chunks may
replay these graphs too, one decode row per token, where their rows' keys stay under
`row_keys_max`; with speculative decoding, verification steps do, from extra sizes
(engine/spec_graphs.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable

import torch

from engine.attention.metadata import AttentionMetadata
from engine.lazy_kernels import kernel
from engine.lora.layers import LoRAContext
from engine.token_choice import argmax

logger = logging.getLogger(__name__)
stage_inputs = kernel("stage_inputs", "stage_inputs")
STAGE_KERNEL = os.environ.get("PDSERVE_STAGE_KERNEL", "1") != "0"


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including `max_batch`."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    # the largest size with an argmax graph (0: none); PDSERVE_ARGMAX_GRAPH_MAX_BATCH sets it
    # for every engine a process starts (benchmarks' A/B runs of whole workers)
    argmax_max_batch = int(os.environ.get("PDSERVE_ARGMAX_GRAPH_MAX_BATCH", "16"))
    # the most keys a step run as decode rows may read in all (engine/spec_graphs.py,
    # `prefill_rows_fit`); PDSERVE_GRAPH_ROW_KEYS sets it for every engine a process starts
    # (0: prompts' chunks always run eagerly)
    row_keys_max = int(os.environ.get("PDSERVE_GRAPH_ROW_KEYS", str(2**18)))

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        lora: LoRAContext | None = None,
        extra_sizes: Iterable[int] = (),
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`extra_sizes`: more padded sizes beside the ladder of `max_batch` (the largest of all
        sizes the buffers' rows). `head`: hidden rows -> their logits (the model's dtype will
        do: an argmax needs no upcast); with it, argmax graphs for the small sizes."""
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.sizes = sorted(set(capture_sizes(max_batch)) | set(extra_sizes))
        max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        blocks = -(-max_model_len // block_size)
        width = -(-blocks // 4) * 4  # rows 16-byte aligned, as engine.input_batch lays them out
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # multi-LoRA: each row's adapter slot (-1: none); the LoRA layers read it on replay
        self.lora_slots = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        # per size, the graph (and its output) without adapters, and with them (multi-LoRA)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_outputs: dict[int, torch.Tensor] = {}
        # per small size, the graph that also picks each row's argmax token, and its tokens
        self.head = head
        self.argmax_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.argmax_outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served by a graph (stats, tests)
        self.argmax_replays = 0  # of them, steps whose tokens the graph picked
        self.row_replays = 0  # of them, steps of short chunks run as decode rows (spec_graphs)
        self.eager = False  # replay = the padded step run eagerly (CPU tests; see `run_eagerly`)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            max_seq_len=self.max_model_len,  # the split count must suit any length
            block_size=self.block_size,
        )

    def _forward(self, size: int, with_lora: bool) -> torch.Tensor:
        meta = self._meta(size)
        before = None if self.lora is None else self.lora.slots
        if with_lora:
            assert self.lora is not None
            self.lora.slots = self.lora_slots[:size]
        try:
            return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        finally:
            if with_lora:
                self.lora.slots = before  # type: ignore[union-attr]

    def _argmax_step(self, size: int) -> torch.Tensor:
        """[size] each row's greedy token (padding rows' too: never read)."""
        assert self.head is not None
        return argmax(self.head(self._forward(size, False)))

    @property
    def ready(self) -> bool:
        return bool(self.graphs) or self.eager

    def release(self) -> None:
        """Destroy every captured graph (no replays after). With tensor parallelism this must
        come before the NCCL communicator is closed: a graph that holds NCCL kernels keeps a
        reference on its communicator, and NCCL's abort waits for those to be dropped (seen on
        two H200s: a TP=2 engine's shutdown hung in the abort while its graphs were alive)."""
        kinds = (self.graphs, self.lora_graphs, self.argmax_graphs)
        for graph in (g for graphs in kinds for g in graphs.values()):
            graph.reset()
        for table in (*kinds, self.outputs, self.lora_outputs, self.argmax_outputs):
            table.clear()

    def run_eagerly(self) -> None:
        """Serve `run` without graphs: the same padded static-buffer step, run eagerly. What a
        replay computes, where no graph can be captured (the CPU): tests of the padding."""
        self.eager = True

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse the shared memory pool); with
        LoRA, each size twice: steps without an adapter replay a graph without the LoRA kernels."""
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        kinds = [(False, self.graphs, self.outputs)]
        if self.lora is not None:
            kinds.append((True, self.lora_graphs, self.lora_outputs))
        for size in reversed(self.sizes):
            for with_lora, graphs, outputs in kinds:
                graphs[size], outputs[size] = _captured(
                    functools.partial(self._forward, size, with_lora), pool)
            if self._has_argmax(size):
                self.argmax_graphs[size], self.argmax_outputs[size] = _captured(
                    functools.partial(self._argmax_step, size), pool)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (%d sizes, batch 1..%d) in %.1f s, %.0f MiB",
                    len(self.sizes) * len(kinds) + len(self.argmax_graphs), len(self.sizes),
                    self.max_batch, time.perf_counter() - start,
                    (torch.cuda.memory_reserved() - reserved) / 2**20)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.ready and meta.num_prefills == 0 and 0 < meta.num_decodes <= self.max_batch

    def _has_argmax(self, size: int) -> bool:
        return self.head is not None and size <= self.argmax_max_batch

    def can_run_argmax(self, meta: AttentionMetadata) -> bool:
        """Whether `run_argmax` serves this step: decode-only, no adapters, a small size. (The
        caller knows whether every row's token is its argmax.)"""
        if not self.can_run(meta) or (self.lora is not None and self.lora.slots is not None):
            return False
        size = self._size(meta.num_decodes)
        return self._has_argmax(size) and (self.eager or size in self.argmax_graphs)

    def _size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [n, hidden]
        """Replay for a decode-only step of n sequences (`can_run` must hold)."""
        n, size, with_lora = self._stage(input_ids, positions, meta)
        graphs, outputs = (self.lora_graphs, self.lora_outputs) if with_lora \
            else (self.graphs, self.outputs)
        if self.eager:
            return self._forward(size, with_lora)[:n]
        graphs[size].replay()
        return outputs[size][:n]

    def run_argmax(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [n] int64
        """Replay for a decode-only greedy step (`can_run_argmax` must hold): each row's argmax
        token, a view of the graph's static output (valid until the next replay of its size)."""
        n, size, _ = self._stage(input_ids, positions, meta)
        self.argmax_replays += 1
        if self.eager:
            return self._argmax_step(size)[:n]
        self.argmax_graphs[size].replay()
        return self.argmax_outputs[size][:n]

    def _stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[int, int, bool]:
        """The step's inputs into the static buffers' first n rows, the padding rows' slots and
        lengths reset: (n, the padded size, whether the step has adapters)."""
        n = meta.num_decodes
        size = self._size(n)
        width = min(meta.block_tables.shape[1], self.block_tables.shape[1])
        # columns past `width` keep older ids: never read, each row's length bounds its reads
        if STAGE_KERNEL and self.input_ids.is_cuda:
            stage_inputs((input_ids, positions, meta.slot_mapping, meta.seq_lens,
                          meta.block_tables),
                         (self.input_ids[:size], self.positions[:size],
                          self.slot_mapping[:size], self.seq_lens[:size],
                          self.block_tables[:size]), n, width)
        else:
            self.input_ids[:n].copy_(input_ids)
            self.positions[:n].copy_(positions)
            self.slot_mapping[:n].copy_(meta.slot_mapping)
            self.seq_lens[:n].copy_(meta.seq_lens)
            if n < size:  # (an empty slice's fill is still a launch's worth of host time)
                self.slot_mapping[n:size].fill_(-1)
                self.seq_lens[n:size].fill_(0)
            self.block_tables[:n, :width].copy_(meta.block_tables[:, :width])
        with_lora = self.lora is not None and self.lora.slots is not None  # a step with adapters
        if with_lora:
            self.lora_slots[:n].copy_(self.lora.slots)  # type: ignore[union-attr]
            if n < size:
                self.lora_slots[n:size].fill_(-1)
        self.replays += 1
        return n, size, with_lora


def _captured(step: Callable[[], torch.Tensor], pool: object
              ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`step` captured into a graph on the shared `pool`, and its static output. Run once
    first, outside the capture: that compiles its kernels (and times the head's GEMV plan)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out
