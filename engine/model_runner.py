"""Owns the model, the KV cache tensors and the sampler; runs one scheduled step on the device."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.distributed.group import SingleRank
from engine.distributed.kv_shards import ShardedKVLayer, sharded_layers
from engine.distributed.sharding import check_heads, kv_head_owners
from engine.input_batch import HostBlockTables, HostStep, PendingTokens, pack_step, step_tensors
from engine.kv_cache_sizing import KVCacheSizingMixin
from engine.lora.slots import LoRASlots
from engine.model_loader import load_hf_config
from engine.models import load_model
from engine.prompt_logprobs import add_chunk_prompt_logprobs
from engine.request_checks import reads_history
from engine.sampler import SampledTokens, Sampler, SamplingRow, argmax_suffices
from engine.sampling_rows import SamplingRows
from engine.scheduler_output import Sample, Samples, ScheduledRequest, SchedulerOutput
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.rejection import verify
from engine.spec_graphs import capture_graphs, forward_step, graph_query_len
from engine.structured.backend import GrammarMatcher
from engine.structured.bitmask import mask_logits
from engine.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank`: cuda:rank (cuda:N+rank from "cuda:N")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from engine.attention.triton_backend import TritonAttentionBackend
        except ImportError:
            if name == "triton":
                raise
        else:
            return TritonAttentionBackend()
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


class LaunchedStep:
    """A step queued on the device; `result()` waits for its samples (request id -> sample).

    A step with grammar-constrained rows queues its forward pass only: their masks need the
    tokens of the step before appended first, so the engine starts the sampling after that
    (`start_sampling`; `result` does it too). The forward runs on the device meanwhile."""

    def __init__(
        self, request_ids: list[str], sampled: SampledTokens | None,
        sample: Callable[[], SampledTokens] | None = None,
    ) -> None:
        self.request_ids, self.sampled, self._sample = request_ids, sampled, sample
        self.verified: dict[str, Samples] = {}  # requests verified with drafts: their tokens

    def start_sampling(self) -> None:
        if self._sample is not None:
            self.sampled, self._sample = self._sample(), None

    def result(self) -> dict[str, Sample | Samples]:
        self.start_sampling()
        results: dict[str, Sample | Samples] = {}
        if self.sampled is not None:
            host = self.sampled.to_host()
            results.update(zip(self.request_ids, zip(host.token_ids, host.logprobs)))
        results.update(self.verified)
        return results


class ModelRunner(KVCacheSizingMixin):
    """Rank 0's runner (`group` None) starts the other tensor-parallel ranks, if any, and sends
    them each step before running it (`launch`); theirs (`group` given) run what it sends
    (`follow`). Each holds its shard of the model and of the KV cache (its KV heads)."""

    def __init__(self, config: EngineConfig, group: SingleRank | None = None):
        self.config = config
        rank = 0 if group is None else group.rank
        self.device = resolve_device(config.device, rank)
        self.hf_config = load_hf_config(config.model)
        self.executor = None
        if group is None and config.parallel.tensor_parallel_size > 1:
            cfg = self.hf_config
            check_heads(cfg.num_attention_heads, cfg.num_key_value_heads,
                        config.parallel.tensor_parallel_size)
            from engine.distributed.executor import TPExecutor

            self.executor = TPExecutor(config, self.device)
            group = self.executor.group
        self.tp: SingleRank = group or SingleRank()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.backend = make_attention_backend(config.attention_backend, self.device)
        self.model = load_model(config, self.hf_config, self.backend, self.device, self.dtype,
                                self.tp)
        self.lora: LoRASlots | None = None  # multi-LoRA: the adapters' slots and host cache
        if config.lora is not None:
            self.lora = LoRASlots(self.model, config.lora, self.device, self.dtype)
        # speculative decoding with a draft model: it shares the block tables, not the cache
        self.drafter: DraftModel | None = None
        spec = config.speculative
        if spec is not None and spec.method == "draft_model" and config.role != "prefill":
            self.drafter = DraftModel(config, self.hf_config, self.device, self.dtype,
                                      make_attention_backend(config.attention_backend,
                                                             self.device))
        self.block_size = config.cache.block_size
        self.num_blocks = self._decide_num_blocks()
        # One allocation for all layers [L, 2, num_blocks, block_size, Hkv, D], so that one CUDA
        # IPC handle or one NIXL registration covers the whole cache (pdserve/transport/);
        # each layer's cache is a view of it.
        self.kv_pool = self._allocate_kv_pool(self.num_blocks)
        if self._shares_pool and self.device.type == "cpu":
            self.kv_pool.share_memory_()  # rank 0 maps it (engine/distributed/kv_shards.py)
        self.kv_caches = list(self.kv_pool.unbind(0))
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, self.block_size)
        self.graphs = self._capture_graphs()
        self.warm_allocator()
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._rows = SamplingRows(self.device)  # each sampling request's, until released
        self._tables = HostBlockTables()  # each scheduled request's block table, until released
        self._pending: PendingTokens | None = None  # the last launch's sampled tokens
        self._pending_ids: torch.Tensor | None = None  # ranks > 0: the same tokens
        self._kv_view: list[ShardedKVLayer] | None = None
        self.structured: StructuredOutputs | None = None  # set by the engine when first used

    # ---- set-up --------------------------------------------------------------------------
    def _capture_graphs(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.config.enforce_eager or self.backend.name != "triton":
            return None
        # With tensor parallelism every rank captures the same sizes in the same order (the
        # warm-ups run the collectives for real, in lockstep), and each graph holds its NCCL
        # all-reduces; a step replays on every rank or on none, chosen from the step's metadata
        # alone, which rank 0 sends (engine/spec_graphs.py: forward_step).
        return self._make_graphs()

    def _make_graphs(self) -> DecodeGraphs:
        """The target's decode graphs (and the draft's, into `self.drafter.graphs`); with
        speculative decoding, sizes for verification steps too (engine/spec_graphs.py)."""
        if self.drafter is not None:
            self.drafter.graphs = capture_graphs(self.config, self.drafter.model,
                                                 self.drafter.kv_caches, self.device)
        return capture_graphs(self.config, self.model, self.kv_caches, self.device,
                              None if self.lora is None else self.lora.ctx, self._argmax_head())

    def _argmax_head(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The logits for the decode graphs' argmax graphs, where a greedy step's tokens may
        come from one: one rank (with tensor parallelism rank 0 broadcasts the tokens it
        sampled to the others), no speculation (verification steps sample otherwise)."""
        if self.tp.world_size > 1 or self.config.speculative is not None:
            return None
        return functools.partial(self.model.compute_logits, upcast=False)

    @property
    def _shares_pool(self) -> bool:
        return self.tp.rank > 0 and self.config.role != "colocated"

    def kv_view(self) -> list[torch.Tensor] | list[ShardedKVLayer]:
        """Per layer, the KV cache a push reads or a received push writes: this process's own
        layers, or with tensor parallelism (rank 0, disaggregated roles) every rank's heads."""
        if self.executor is None:
            return self.kv_caches
        if self._kv_view is None:
            cfg = self.hf_config
            pools = [self.kv_pool, *self.executor.peer_pools(self.config.parallel.timeout_s)]
            heads = kv_head_owners(cfg.num_attention_heads, cfg.num_key_value_heads,
                                   self.tp.world_size)
            self._kv_view = sharded_layers(pools, heads)
        return self._kv_view

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, on_layer: Callable[[int], None] | None = None
    ) -> LaunchedStep:
        """Queue `out`'s forward pass (it writes the new tokens' K/V into the cache) and the
        sampling of the sequences whose chunk reaches their end, without waiting for either.
        Input tokens still pending (sampled by the previous launch, not appended yet) are read
        from that launch's results on the device. `on_layer`: see `LlamaForCausalLM.forward`
        (not called for a step replayed from a CUDA graph)."""
        loads: list = []  # LoRA adapters to put into device slots before the step
        token_loras = None
        if self.lora is not None:
            def token_loras(order: list[ScheduledRequest]) -> list[int] | None:
                planned, per_token = self.lora.plan(order)  # type: ignore[union-attr]
                loads.extend(planned)
                return per_token
        host, order = pack_step(out, self.block_size, self._pending, token_loras, self._tables)
        for slot, request in loads:
            self.lora.place(slot, request)  # type: ignore[union-attr]
        if self.executor is None:
            return self._launch(host, order, on_layer)
        try:
            for slot, request in loads:
                self.executor.send_lora(slot, request)
            self.executor.send_step(host)
            return self._launch(host, order, on_layer)
        except (RuntimeError, OSError) as exc:  # a collective failed, a rank's pipe broke
            raise self.executor.failure(exc) from exc

    def _launch(
        self, host: HostStep, order: list, on_layer: Callable[[int], None] | None
    ) -> LaunchedStep:
        pending = self._pending.token_ids if self._pending is not None else None
        inp = step_tensors(host, self.block_size, self.device, pending)
        if self.lora is not None:
            self.lora.ctx.slots = inp.lora_slots
        sampling = [s for s in order if s.samples]
        graphs = self._argmax_graphs(inp.meta, order, sampling) if on_layer is None else None
        if graphs is not None:
            ids = [s.request.request_id for s in sampling]
            tokens = graphs.run_argmax(inp.input_ids, inp.positions, inp.meta)
            self._pending = PendingTokens(tokens, {rid: i for i, rid in enumerate(ids)})
            return LaunchedStep(ids, SampledTokens(tokens, None))
        hidden = self._forward(inp.input_ids, inp.positions, inp.meta, on_layer)
        for i, s in enumerate(order):
            if s.request.sampling_params.prompt_logprobs is not None:
                q0 = inp.meta.query_start_loc_cpu[i]
                add_chunk_prompt_logprobs(self.model, s.request,
                                          hidden[q0:q0 + s.num_new_tokens], s.start)
        if self.config.speculative is not None and any(s.spec_token_ids for s in sampling):
            return self._launch_verify(hidden[inp.sample_rows], sampling)
        return self._launch_sampling(hidden[inp.sample_rows], sampling)

    def _argmax_graphs(
        self, meta: AttentionMetadata, order: list[ScheduledRequest],
        sampling: list[ScheduledRequest],
    ) -> DecodeGraphs | None:
        """The graphs whose argmax graph gives this step's tokens, if any: a decode step they
        serve where every row samples its argmax (no logprobs, penalties, grammar or drafts)."""
        graphs = self.graphs
        if graphs is None or len(sampling) != len(order) or not graphs.can_run_argmax(meta):
            return None
        if any(s.spec_token_ids or s.request.grammar is not None
               or s.request.sampling_params.prompt_logprobs is not None for s in order):
            return None
        rows = [self._rows.row(s.request) for s in sampling]
        return graphs if argmax_suffices(rows) else None

    def _launch_sampling(
        self, hidden: torch.Tensor, sampling: list[ScheduledRequest]
    ) -> LaunchedStep:
        """Sample one token for each of `sampling`, from its row of `hidden` [N, hidden]."""
        if not sampling:
            self._pending = None
            return LaunchedStep([], None)
        rows = [self._rows.row(s.request) for s in sampling]
        logits = self.model.compute_logits(hidden, upcast=not argmax_suffices(rows))
        ids = [s.request.request_id for s in sampling]
        matchers = [s.request.grammar for s in sampling]
        if any(m is not None for m in matchers):  # sampled once the step before is appended
            self._pending = None
            return LaunchedStep(ids, None, functools.partial(
                self._sample, logits, rows, ids, matchers))
        return LaunchedStep(ids, self._sample(logits, rows, ids, None))

    def _launch_verify(
        self, hidden: torch.Tensor, sampling: list[ScheduledRequest]
    ) -> LaunchedStep:
        """A step with draft tokens: `hidden` [N, hidden] has 1 + k rows for a request with k
        drafts (engine/spec_decode/rejection.py verifies them now), one for the others (sampled
        as usual). Speculative steps never overlap, so none of this is pending for the next."""
        plain, spec, plain_rows, spec_rows = [], [], [], []
        row = 0
        for s in sampling:
            n = 1 + len(s.spec_token_ids)
            (spec if n > 1 else plain).append(s)
            (spec_rows if n > 1 else plain_rows).extend(range(row, row + n))
            row += n
        launched = self._launch_sampling(hidden[plain_rows], plain)
        rows = [r for s in spec for r in self._draft_rows(s)]
        logits = self.model.compute_logits(hidden[spec_rows], upcast=not argmax_suffices(rows))
        drafts = [s.spec_token_ids for s in spec]
        matchers = [s.request.grammar for s in spec]
        if any(m is not None for m in matchers):  # each position's grammar mask, drafts walked
            mask = self.structured.draft_bitmask(matchers, drafts)  # type: ignore[union-attr]
            logits = mask_logits(logits, mask)
        emitted = verify(logits, rows, drafts, self.default_generator)
        launched.verified = {s.request.request_id: e for s, e in zip(spec, emitted)}
        return launched

    def _draft_rows(self, s: ScheduledRequest) -> list[SamplingRow]:
        """The sampling rows of a request's last token and of each of its drafts: row j sees
        the drafts before it as output history (one row for all when nothing reads it)."""
        row = self._rows.row(s.request)
        drafts = s.spec_token_ids
        if not reads_history(s.request.sampling_params):
            return [row] * (len(drafts) + 1)
        return [row] + [dataclasses.replace(row, output_token_ids=row.output_token_ids
                                            + drafts[:j]) for j in range(1, len(drafts) + 1)]

    @torch.inference_mode()
    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], ids: list[str],
        matchers: list[GrammarMatcher | None] | None,
    ) -> SampledTokens:
        bitmask = None if matchers is None else self.structured.bitmask(matchers)  # type: ignore[union-attr]
        sampled = self.sampler.sample(logits, rows, self.default_generator, bitmask)
        self._pending = PendingTokens(sampled.token_ids, {rid: i for i, rid in enumerate(ids)})
        if self.tp.world_size > 1:
            try:
                self.tp.broadcast(sampled.token_ids)  # the other ranks' next pending tokens
            except RuntimeError as exc:
                raise self.executor.failure(exc) from exc  # type: ignore[union-attr]
        return sampled

    @torch.inference_mode()
    def follow(self, host: HostStep) -> None:
        """Ranks > 0: run the step rank 0 sent, in lockstep with it (the same collectives in
        the same order); keep rank 0's sampled tokens for the next step's pending inputs."""
        inp = step_tensors(host, self.block_size, self.device, self._pending_ids)
        if self.lora is not None:
            self.lora.ctx.slots = inp.lora_slots
        hidden = self._forward(inp.input_ids, inp.positions, inp.meta, None)
        if not host.num_samples:
            self._pending_ids = None
            return
        self.model.compute_logits(hidden[inp.sample_rows], upcast=False)
        ids = torch.empty(host.num_samples, dtype=torch.int64, device=self.device)
        self._pending_ids = self.tp.broadcast(ids)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None,
    ) -> torch.Tensor:
        return forward_step(self.model, self.kv_caches, self.backend, self.graphs, input_ids,
                            positions, meta, graph_query_len(self.config), on_layer)

    def mark_ready(self) -> torch.cuda.Event | None:
        """An event recorded on the compute stream now (CUDA): work queued so far is done once
        it completes. None on the CPU, where a step's ops have finished when they return."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def on_rank_failure(self, callback: Callable[[RuntimeError], None]) -> None:
        """Call `callback` when another tensor-parallel rank dies (no-op without TP)."""
        if self.executor is not None:
            self.executor.on_failure(callback)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (no-op without TP), first destroying this
        rank's CUDA graphs, which hold the communicator the stop closes."""
        if self.executor is not None:
            self.release_graphs()
            self.executor.stop()

    def release_graphs(self) -> None:
        """Destroy the target's and the draft's CUDA graphs (steps run eagerly after)."""
        if self.drafter is not None and self.drafter.graphs is not None:
            self.drafter.graphs.release()
            self.drafter.graphs = None
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def release(self, request_id: str) -> None:
        """Forget per-request state (its seeded generator, sampling row and host block table)
        once the request is finished."""
        self._rows.release(request_id)
        self._tables.forget(request_id)
