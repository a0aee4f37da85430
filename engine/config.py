"""Engine configuration: frozen dataclasses, validated once, built at the entry point.

Torch-free: dtypes and devices are names here; the model runner turns them into torch objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. `num_blocks` (tests, services) wins over the `kv_cache_memory` byte budget;
    with neither, the runner sizes the cache from the device's free memory."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. `max_num_batched_tokens` is the per-step token budget shared by
    decodes (one token each) and prefill chunks."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass(frozen=True)
class KVWaitConfig:
    """Decode role: how a reservation that finds the KV cache full waits for free blocks, first
    come first served: up to `seconds`, with at most `max_requests` waiting at a time. With 0 of
    either it fails at once."""

    seconds: float = 0.0
    max_requests: int = 0

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {self.seconds}")
        if self.max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {self.max_requests}")

    @property
    def max_waiting(self) -> int:
        """How many reservations may wait at a time (0: none)."""
        return self.max_requests if self.seconds > 0 else 0


NO_KV_WAIT = KVWaitConfig()  # a full cache fails a reservation at once


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one process per rank (engine/distributed/). Rank r runs on device
    `cuda:r` of the visible ones (`cuda:N` starts at N) or on the CPU (gloo). A collective that
    waits longer than `timeout_s` (a rank died or hangs) fails the step and the engine."""

    tensor_parallel_size: int = 1
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"distributed timeout must be > 0 seconds, got {self.timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs. `model` is a resolved local path (HF folder or .gguf)."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    role: str = "colocated"
    attention_backend: str = "auto"  # "torch" | "triton" | "auto"
    # CUDA only: False captures CUDA graphs of decode steps for batches up to
    # min(max_num_seqs, 512); True runs every step eagerly (vLLM's flag of the same name).
    enforce_eager: bool = False
    # Schedule and launch step N+1 before waiting for step N's tokens (see engine.llm_engine);
    # colocated and decode roles. False waits for every step (vLLM's --async-scheduling off).
    async_scheduling: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto|torch|triton, got {self.attention_backend!r}"
            )
