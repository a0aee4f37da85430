"""A serving engine's tokens per step and running requests when none are given: larger on large
GPUs, as vLLM's server.

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

NOTE: `max_num_seqs` caps the requests a step decodes. vLLM's server takes 1024 on those large
GPUs and 256 on the others. Measured here with pdserve's 64 on every device (docs/loadtest.md,
one H100, 2026-12-05, the same load): a third of a burst's 96 requests waited for a seat, in
the colocated server for their prefill and in the split's decode worker with their KV in
place (handover p90 614 ms), until the first 64 finished; the output rate at saturation is
then two rounds of decode steps instead of one (with vLLM's values, a later call: the
colocated server's burst took 830 ms against 1084, the split's handover p90 82 ms). So a
server on a GPU takes vLLM's values; the
CPU keeps 64 (its steps are the matmuls, and a CPU step of 64 rows of the bundled model is
already ~0.2 s), and so does the offline `LLM` everywhere.
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
CPU_SEQS, GPU_SEQS, LARGE_GPU_SEQS = 64, 256, 1024


def server_limits(device: str) -> tuple[int, int]:
    """The server's default (max_num_batched_tokens, max_num_seqs) on `device` ("auto", "cpu",
    "cuda[:N]")."""
    resolved = resolve_device(device)
    if resolved.type != "cuda" or not torch.cuda.is_available():
        return SMALL_BUDGET, CPU_SEQS
    props = torch.cuda.get_device_properties(resolved)
    return gpu_limits(props.total_memory, props.name)


def gpu_limits(total_bytes: int, name: str) -> tuple[int, int]:
    """vLLM's rule (see the NOTEs): 8192 tokens and 1024 requests from 70 GiB, except an A100;
    else 2048 and 256."""
    if total_bytes >= LARGE_GPU_BYTES and "a100" not in name.lower():
        return LARGE_GPU_BUDGET, LARGE_GPU_SEQS
    return SMALL_BUDGET, GPU_SEQS


def with_server_budget(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`LLM`'s arguments for a serving engine: without `max_num_batched_tokens` (and with
    chunked prefill) a step takes the server's budget for the device, without `max_num_seqs`
    (None) the server's cap of running requests."""
    want_tokens = (kwargs.get("max_num_batched_tokens") is None
                   and kwargs.get("enable_chunked_prefill", True))
    want_seqs = kwargs.get("max_num_seqs") is None
    if not (want_tokens or want_seqs):
        return kwargs
    tokens, seqs = server_limits(kwargs.get("device", "auto"))
    kwargs = dict(kwargs)
    if want_tokens:
        kwargs["max_num_batched_tokens"] = tokens
    if want_seqs:
        kwargs["max_num_seqs"] = seqs
    logger.info("max_num_batched_tokens %d, max_num_seqs %d (the server's defaults on this "
                "device where not given)", kwargs.get("max_num_batched_tokens") or tokens,
                kwargs["max_num_seqs"])
    return kwargs
