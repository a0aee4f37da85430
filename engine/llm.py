"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.llm_engine import LLMEngine, PromptInput
from engine.lora.request import LoRARequest
from engine.model_loader import load_hf_config, resolve_model
from engine.outputs import RequestOutput
from engine.quant import resolve_quantization
from engine.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


def build_engine_config(
    model: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    kv_cache_memory: int | None = None,
    num_kv_blocks: int | None = None,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    gpu_memory_utilization: float = 0.9,
    seed: int = 0,
    device: str = "auto",
    attention_backend: str = "auto",
    role: str = "colocated",
    enforce_eager: bool = False,
    decode_gemv: bool = True,
    async_scheduling: bool = True,
    tensor_parallel_size: int = 1,
    distributed_timeout_s: float = 60.0,
    enable_expert_parallel: bool = False,
    speculative_config: dict | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    stream_interval: int = 1,
    shared_gpu_pace_ms: float = 0.0,
    shared_gpu_pace_tokens: int = 2048,
    shared_gpu_step_marks: str | None = None,
) -> EngineConfig:
    """Resolve the model and turn user-facing arguments into an `EngineConfig` (ValueError on
    bad values). `max_model_len` defaults to the model's context length. `speculative_config`:
    vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3} (`SpeculativeConfig`).
    `quantization`: vLLM's names, None to pick from the checkpoint, "none" to de-quantize a
    GGUF (`engine.quant.resolve_quantization`). `kv_cache_dtype`: "auto" (the model's dtype) or
    "fp8" / "fp8_e4m3" (kernels/kv_cache_fp8.py). `enable_lora`: serve PEFT LoRA adapters, up to
    `max_loras` in one batch, of rank <= `max_lora_rank`, `max_cpu_loras` loaded (`LoRAConfig`).
    `decode_gemv`: see `EngineConfig`. `stream_interval`: a streamed request's outputs go out
    with its first token, then every that many tokens, and at its end (`SchedulerConfig`).
    `shared_gpu_pace_ms` / `_tokens` / `_step_marks`: a decode worker's steps paced beside a
    prefill worker on its GPU (`SchedulerConfig`)."""
    speculative = None if speculative_config is None else SpeculativeConfig.from_dict(
        speculative_config)
    path = resolve_model(model)
    model_len = getattr(load_hf_config(path), "max_position_embeddings", 2048)
    if max_model_len is None:
        max_model_len = model_len
    elif max_model_len > model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context {model_len}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len)
    quantization = resolve_quantization(quantization, path, device, dtype, tensor_parallel_size)
    lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
    return EngineConfig(
        model=path,
        dtype=dtype,
        device=device,
        seed=seed,
        role=role,
        attention_backend=attention_backend,
        enforce_eager=enforce_eager,
        decode_gemv=decode_gemv,
        async_scheduling=async_scheduling,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            num_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            max_loras=None if lora is None else lora.max_loras,
            stream_interval=stream_interval,
            shared_gpu_pace_ms=shared_gpu_pace_ms,
            shared_gpu_pace_tokens=shared_gpu_pace_tokens,
            shared_gpu_step_marks=shared_gpu_step_marks,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size, timeout_s=distributed_timeout_s,
            enable_expert_parallel=enable_expert_parallel,
        ),
        speculative=speculative,
        lora=lora,
    )


class LLM:
    """Generate for a list of prompts in one process, batching them continuously.

    With `model=None` serves the bundled SmolLM2-135M-Instruct. See `build_engine_config` for
    the arguments.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.llm_engine = LLMEngine(build_engine_config(model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput] | dict | Sequence[dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string, a list of token ids, or `{"prompt": ...}` /
        `{"prompt_token_ids": [...]}`. One `SamplingParams` serves all, or give one per prompt;
        the same for `lora_request` (None: the base model). Bad input raises ValueError before
        anything runs.
        """
        prompt_list = _as_prompt_list(prompts)
        loras = _per_prompt_lora(lora_request, len(prompt_list))
        # Only finished outputs are returned: ask for nothing else (vLLM's LLM does the same),
        # which also lets the engine detokenize each sequence once, at its end.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in _per_prompt(sampling_params, len(prompt_list))]
        ids = [str(next(self._ids)) for _ in prompt_list]
        try:
            for request_id, prompt, p, lora in zip(ids, prompt_list, params, loras):
                self.llm_engine.add_request(request_id, prompt, p, lora_request=lora)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate. One conversation
        (a list of `{"role", "content"}` dicts) gives a list of one output."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("the model has no chat template; pass chat_template")
        prompts = []
        for conv in conversations:
            _check_conversation(conv)
            ids = tok.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=chat_template, return_dict=False,
            )
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm
        )
        start, in_toks, out_toks = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                done[out.request_id] = out
                in_toks += len(out.prompt_token_ids)
                out_toks += sum(len(c.token_ids) for c in out.outputs)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"est. speed input: {in_toks / elapsed:.1f} toks/s, "
                    f"output: {out_toks / elapsed:.1f} toks/s", refresh=False,
                )
                bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts: Any) -> list[PromptInput]:
    single_ids = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    if isinstance(prompts, (str, dict)) or single_ids:
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of them")
    return [_one_prompt(p) for p in prompts]


def _one_prompt(p: Any) -> PromptInput:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(p, (str, list)):
        return p
    raise ValueError(f"prompt must be a string or a list of token ids, got {type(p).__name__}")


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("sampling_params must be SamplingParams objects")
    return params


def _per_prompt_lora(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if not isinstance(lora, (list, tuple)):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got "
                         f"{type(lora).__name__}")
    if len(lora) != n:
        raise ValueError(f"lora_request has {len(lora)} entries for {n} prompts")
    if not all(r is None or isinstance(r, LoRARequest) for r in lora):
        raise ValueError("lora_request entries must be LoRARequest objects or None")
    return list(lora)


def _check_conversation(conv: Any) -> None:
    if not isinstance(conv, (list, tuple)) or not conv:
        raise ValueError("messages: each conversation must be a non-empty list")
    for m in conv:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("messages: each message needs 'role' and 'content'")
