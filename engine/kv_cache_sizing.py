"""How big the KV cache is and how it is allocated: the model runner's share of set-up that
decides the number of blocks (`ModelRunner` mixes this in).

On CUDA, vLLM's rule: the cache gets `gpu_memory_utilization` of the card, less what is in use
(weights, CUDA context, other processes) and the activation peak of the largest step, measured
by running one dummy step; on the CPU a fixed default. Every tensor-parallel rank ends up with the
fewest blocks any rank can hold; with a draft model each block also holds the draft's K/V.
The cache's dtype is the model's, or fp8 with `kv_cache_dtype="fp8"`: 1 byte an element, so the
same budget holds twice the blocks of a bf16 cache (the draft model keeps its own dtype).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine import zero_pages
from engine.attention.metadata import AttentionMetadata
from engine.distributed.sharding import head_shard
from engine.models.llama import head_dim_of
from kernels.kv_cache_fp8 import KV_FP8

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend
    from engine.config import EngineConfig
    from engine.distributed.group import SingleRank
    from engine.spec_decode.draft_model import DraftModel

logger = logging.getLogger("engine.model_runner")

CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on CPU, like vLLM's CPU backend
GRAPH_RESERVE_BYTES = 512 << 20  # CUDA-graph pool and allocator slack, kept out of the KV budget


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for `EngineConfig.kv_cache_dtype` (KV_CACHE_DTYPES)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return KV_FP8
    raise ValueError(f"kv_cache_dtype {name!r} is not implemented")


class KVCacheSizingMixin:
    """Uses the runner's config, hf_config, tp, device, dtype, model, backend, drafter and
    block_size."""

    config: EngineConfig
    hf_config: object
    tp: SingleRank
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    backend: AttentionBackend
    drafter: DraftModel | None
    block_size: int

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype of the KV pool: the model's, or fp8."""
        return resolve_kv_cache_dtype(self.config.kv_cache_dtype, self.dtype)

    @property
    def kv_shape_per_layer(self) -> tuple[int, int]:
        """(KV heads of this rank, head dim)."""
        cfg = self.hf_config
        heads = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads,
                           self.tp.world_size, self.tp.rank)
        return len(heads.kv_heads), head_dim_of(cfg)

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (K and V)."""
        kv_heads, head_dim = self.kv_shape_per_layer
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * self.hf_config.num_hidden_layers * self.block_size * kv_heads * head_dim * elem

    def _decide_num_blocks(self) -> int:
        """Every rank's cache has the same number of blocks: the fewest any rank can hold."""
        return self.tp.min_host(self._num_blocks_here())

    def _num_blocks_here(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        budget = cache.kv_cache_memory
        if budget is None:
            budget = self._cuda_free_bytes() if self.device.type == "cuda" else CPU_KV_CACHE_BYTES
        per_block = self.block_bytes()
        if self.drafter is not None:  # each block also holds the draft model's K/V
            per_block += self.drafter.block_bytes(self.block_size)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds no KV block ({per_block} bytes)"
            )
        return int(num_blocks)

    def _cuda_free_bytes(self) -> int:
        """vLLM's rule: the KV cache gets gpu_memory_utilization of the card, less what is in
        use now (weights, CUDA context, other processes) and the activation peak of the largest
        step, measured by running one (`_profile_activation_bytes`)."""
        peak = self._profile_activation_bytes()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - (total - free)
        return int(max(budget - peak - GRAPH_RESERVE_BYTES, 0))

    @torch.inference_mode()
    def _profile_activation_bytes(self) -> int:
        """Peak bytes allocated by the largest step (`_largest_step`) over a one-block cache."""
        cache = list(self._allocate_kv_pool(1, log=False).unbind(0))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        tokens = self._largest_step(cache)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        logger.info("activation peak of a %d-token step: %.0f MiB", tokens, peak / 2**20)
        return int(peak)

    @torch.inference_mode()
    def warm_allocator(self) -> None:
        """Run the largest step once over the real cache (CUDA), so that the caching allocator
        holds its activations' memory before the first burst of prompts needs it.

        NOTE: why. The sizing above frees what its step allocated (`empty_cache`), and the
        decode graphs draw on a pool of their own, so without this the first full-budget prefill
        step of a server grows the allocator mid-serving: new device allocations inside the
        step, which synchronise (on one H100, the first long prefill steps of a burst took 51-54
        ms where later ones of the same size counted their time as waiting for the GPU
        instead). vLLM warms the same way (a dummy run of the token budget after capturing)."""
        if self.device.type != "cuda":
            return
        reserved = torch.cuda.memory_reserved(self.device)
        tokens = self._largest_step(self.kv_caches)
        torch.cuda.synchronize(self.device)
        logger.info("allocator warmed by a %d-token step: %.0f MiB more reserved", tokens,
                    (torch.cuda.memory_reserved(self.device) - reserved) / 2**20)

    def _largest_step(self, cache: list[torch.Tensor]) -> int:
        """Queue the largest step the scheduler can make over `cache`: a forward over the full
        token budget (prompts of max_model_len) and a full batch of logits with the sampler's
        largest temporaries. It reads block 0 and writes no KV (every slot -1); returns its
        token count."""
        sched = self.config.scheduler
        tokens = sched.max_num_batched_tokens
        lens = [sched.max_model_len] * (tokens // sched.max_model_len)
        lens += [tokens % sched.max_model_len] if tokens % sched.max_model_len else []
        width = -(-max(lens) // self.block_size)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            num_prefills=len(lens), num_prefill_tokens=tokens, num_decodes=0,
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(len(lens), width, dtype=torch.int32, device=self.device),
            query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens),
            block_size=self.block_size,
        )
        self.backend.prepare(meta)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, ids, cache, meta)
        spec = self.config.speculative
        per_seq = 1 + (spec.num_speculative_tokens or 0) if spec is not None else 1
        rows = min(sched.max_num_seqs * per_seq, tokens)  # a verification samples 1 + k rows
        logits = self.model.compute_logits(hidden[:rows])
        torch.log_softmax(logits, dim=-1).exp_()  # the sampler's largest temporaries
        return tokens

    def _allocate_kv_pool(self, num_blocks: int, log: bool = True) -> torch.Tensor:
        kv_heads, head_dim = self.kv_shape_per_layer
        shape = (2, num_blocks, self.block_size, kv_heads, head_dim)
        layers = self.hf_config.num_hidden_layers
        if log:
            logger.info(
                "KV cache: %d blocks of %d tokens, %s, %.1f MiB",
                num_blocks, self.block_size, str(self.kv_cache_dtype).removeprefix("torch."),
                num_blocks * self.block_bytes() / 2**20,
            )
        if self.config.cache.shared_pool and self.device.type == "cpu":
            pool, self.kv_pool_fd = zero_pages.shared_zeros((layers, *shape), self.kv_cache_dtype)
            return pool
        return zero_pages.zeros((layers, *shape), self.kv_cache_dtype, self.device)
