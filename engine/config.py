"""Engine configuration: frozen dataclasses, validated once, built at the entry point.

Torch-free: dtypes and devices are names here; the model runner turns them into torch objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from kernels.cache_root import cache_root

DTYPES = ("auto", "float32", "bfloat16", "float16")
ROLES = ("colocated", "prefill", "decode")
# vLLM's names: "auto" keeps K/V in the model's dtype; "fp8" (= "fp8_e4m3") stores them as
# float8_e4m3fn with a per-tensor scale (kernels/kv_cache_fp8.py): half the bytes of bf16.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's names; engine/quant/ implements "fp8" (quantized on load, or FP8 checkpoints), "awq",
# "gptq" and "compressed-tensors" (4-bit W4A16 checkpoints) and "gguf" (kept quantized:
# by default on the CPU, on CUDA when named). None: unquantized weights. A compressed-tensors
# FP8 checkpoint is served as "fp8".
QUANTIZATIONS = ("fp8", "awq", "gptq", "compressed-tensors", "gguf")
IMPLEMENTED_QUANTIZATIONS = QUANTIZATIONS
QUANTIZATION_CHOICES = ("none", *QUANTIZATIONS)  # the user's: "none" de-quantizes a GGUF
KV_CACHE_DTYPE_HELP = (
    "KV cache storage, vLLM's names: auto (the model's dtype) or fp8 (= fp8_e4m3: "
    "float8_e4m3fn, scale 1.0, half the bytes of bf16); prefill and decode workers must agree"
)
QUANTIZATION_HELP = (
    "quantized weights, vLLM's names: fp8 (quantizes a bf16/fp16/fp32 checkpoint on load or "
    "reads an FP8 one, compressed-tensors FP8 too), awq / gptq / compressed-tensors (4-bit "
    "W4A16 checkpoints), gguf; none de-quantizes a GGUF; default: from the checkpoint (FP8 and "
    "4-bit checkpoints stay quantized, a GGUF on the CPU with dtype auto too)"
)


def default_gemv_cache() -> str:
    """The plan file in kernels/cache_root.py's folder."""
    return os.path.join(cache_root(), "decode_gemv_plans.json")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. `num_blocks` (tests, services) wins over the `kv_cache_memory` byte budget;
    with neither, the runner sizes the cache from the device's free memory."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # On the CPU: the pool in a memfd another process maps (the runner's `kv_pool_fd`): a
    # decode worker's server writes received KV into its engine process's pool that way.
    shared_pool: bool = False

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
    decodes (one token each) and prefill chunks. `max_loras`: at most that many distinct LoRA
    adapters among the running requests (None: no adapters). `stream_interval`: a streamed
    request's output goes out with its first token, then once every that many tokens, and when
    it finishes (vLLM's `--stream-interval`: fewer messages per token for every hop after the
    engine; 1: every step).

    `shared_gpu_pace_ms`, a decode worker's beside a prefill worker on the same GPU (two
    processes time-slicing it): while the prompts reserved here and not yet arrived hold at
    least `shared_gpu_pace_tokens` tokens (a burst being prefilled next door; 0: never by
    tokens), a step starts at most once every that many milliseconds (0: never held). Each
    decode step reads every weight, GPU time the prefill waits for; fewer, fuller steps leave
    the GPU to it, as a colocated engine's decodes ride inside its prefill steps.
    `shared_gpu_step_marks`: a folder per GPU where its prefill engines mark each small step in
    flight (engine/gpu_step_marks.py); a decode engine with a pace also holds its steps, up to
    the pace, while one is marked."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_loras: int | None = None
    stream_interval: int = 1
    shared_gpu_pace_ms: float = 0.0
    shared_gpu_pace_tokens: int = 0
    shared_gpu_step_marks: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shared_gpu_pace_tokens < 0:
            raise ValueError(
                f"shared_gpu_pace_tokens must be >= 0, got {self.shared_gpu_pace_tokens}")
        if not self.shared_gpu_pace_ms >= 0:
            raise ValueError(f"shared_gpu_pace_ms must be >= 0, got {self.shared_gpu_pace_ms}")
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
    waits longer than `timeout_s` (a rank died or hangs) fails the step and the engine.
    `enable_expert_parallel`: MoE experts whole on ranks (EP size = TP size), not sliced.
    On CUDA every rank captures the decode CUDA graphs (unless `enforce_eager`), each graph
    holding its NCCL all-reduces."""

    tensor_parallel_size: int = 1
    timeout_s: float = 60.0
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"distributed timeout must be > 0 seconds, got {self.timeout_s}")


SPEC_METHODS = ("ngram", "draft_model")  # implemented; vLLM's others are refused by name
_LATER_SPEC_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode/), with vLLM's names and defaults. Each step
    proposes up to `num_speculative_tokens` tokens per decoding request, verified in one forward.

    "ngram" (prompt lookup): the tokens that followed the most recent earlier occurrence of the
    sequence's longest suffix n-gram, n between `prompt_lookup_min` and `prompt_lookup_max` (one
    given: both; neither: 5). "draft_model": the greedy guesses of the smaller model at `model`
    (the target's tokenizer; the default method when `model` is given). `disable_by_batch_size`:
    no drafts while that many requests are running or waiting."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    # no drafts in a step while this many requests or more are running or waiting (vLLM's
    # name): where the forward is compute-bound, a verified draft costs a token's compute
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method or ("draft_model" if self.model is not None else "ngram")
        object.__setattr__(self, "method", method)
        if method in _LATER_SPEC_METHODS:
            raise ValueError(f"speculative method {method!r} is not implemented yet; "
                             f"use one of {SPEC_METHODS}")
        if method not in SPEC_METHODS:
            raise ValueError(f"method must be one of {SPEC_METHODS}, got {method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens is required for the {method} method")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config.model (the draft's path) is required for "
                                 "the draft_model method")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("prompt_lookup_min/max apply to the ngram method only")
            return
        if self.model is not None:
            raise ValueError("speculative_config.model applies to the draft_model method only")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if low < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {low}")
        if high < low:
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min ({low}), got {high}")

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From `LLM(speculative_config={...})` or `--speculative-config JSON`; ValueError on
        keys it does not know."""
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (engine/lora/), vLLM's names: up to `max_loras` adapters in one step (device
    slots), each of rank <= `max_lora_rank`; up to `max_cpu_loras` adapters loaded in host
    memory (default: max_loras), the least recently used idle one evicted for a new one."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


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
    # CUDA only: at load, time pdserve's Triton GEMV against cuBLAS for each dense projection
    # shape at 1-4 tokens and use it where it measured faster (engine/models/gemv_plan.py);
    # False: cuBLAS everywhere.
    decode_gemv: bool = True
    # Where the GEMV choices are recorded for every later process on this host with the same GPU
    # model and software (engine/models/gemv_plan_store.py), so that they all pick the same
    # kernels; None: time them in every process.
    decode_gemv_cache: str | None = field(default_factory=default_gemv_cache)
    # Schedule and launch step N+1 before waiting for step N's tokens (see engine.llm_engine);
    # colocated and decode roles. False waits for every step (vLLM's --async-scheduling off).
    async_scheduling: bool = True
    # Weights kept quantized (engine/quant/): None (plain or de-quantized) or one of
    # QUANTIZATIONS; `engine.quant.resolve_quantization` picks it from the user's choice.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # None: no speculative decoding. On: steps do not overlap (async_scheduling is ignored).
    speculative: SpeculativeConfig | None = None
    # None: no adapters (vLLM's enable_lora=False).
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization is not None and self.quantization not in IMPLEMENTED_QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not implemented yet "
                             f"(implemented: {IMPLEMENTED_QUANTIZATIONS})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto|torch|triton, got {self.attention_backend!r}"
            )
        if self.speculative is not None and self.parallel.tensor_parallel_size > 1:
            raise ValueError("speculative decoding with tensor_parallel_size > 1 is not "
                             "supported yet")
