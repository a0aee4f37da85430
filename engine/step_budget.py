"""A serving engine's tokens per step when none is given: larger on large GPUs, as vLLM's server.

NOTE: with chunked prefill a step carries at most `max_num_batched_tokens` tokens. 2048 keeps a
decode step that also carries prompt chunks short, but each step has a fixed host cost (the
eager launches of a prefill step, the sampling read-back, the scheduler), and on a large GPU a
2048-token forward of a 1B model takes a few milliseconds: the engine is then host-bound while
prompts wait. vLLM's server uses 8192 on GPUs of >= 70 GiB except the A100 (where its PR #17885
measured larger budgets losing throughput) and 2048 elsewhere. Measured here (docs/loadtest.md,
one H200, the 1B shape, 96 requests all at once): 8192 took the split's goodput from 12.2 to
34.0 req/s and the colocated server's from 19.5 to 29.8, and TTFT p50 from 616 to 478 ms and
from 445 to 315 ms. The offline `LLM` keeps 2048 (its throughput with larger budgets is not
measured).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.model_runner import resolve_device

logger = logging.getLogger(__name__)
SMALL_BUDGET = 2048
LARGE_GPU_BUDGET = 8192
LARGE_GPU_BYTES = 70 << 30


def server_step_tokens(device: str) -> int:
    """The server's default max_num_batched_tokens on `device` ("auto", "cpu", "cuda[:N]")."""
    resolved = resolve_device(device)
    if resolved.type != "cuda" or not torch.cuda.is_available():
        return SMALL_BUDGET
    props = torch.cuda.get_device_properties(resolved)
    return large_gpu_budget(props.total_memory, props.name)


def large_gpu_budget(total_bytes: int, name: str) -> int:
    """vLLM's rule (see the NOTE): 8192 from 70 GiB, except an A100; else 2048."""
    if total_bytes >= LARGE_GPU_BYTES and "a100" not in name.lower():
        return LARGE_GPU_BUDGET
    return SMALL_BUDGET


def with_server_budget(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`LLM`'s arguments for a serving engine: without `max_num_batched_tokens` (and with
    chunked prefill) a step takes the server's budget for the device."""
    if kwargs.get("max_num_batched_tokens") is None and kwargs.get("enable_chunked_prefill", True):
        budget = server_step_tokens(kwargs.get("device", "auto"))
        logger.info("max_num_batched_tokens %d (the server's default on this device)", budget)
        kwargs = {**kwargs, "max_num_batched_tokens": budget}
    return kwargs
