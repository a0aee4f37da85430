"""The decode profile's step (pdserve/bench/gpu_decode_profile.py, step 3): a batch-1 decode graph
over a cache of CONTEXT tokens, timed replay by replay, and profiled (torch.profiler) eager, one
range per sublayer, and in replay.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.cuda_timing import graph_us, replays_ms

CONTEXT = 256  # tokens in the cache at the profiled step (the latency bench's 128 + up to 256)
LABELS = {"self_attn.qkv_proj": "qkv", "self_attn.o_proj": "o_proj", "self_attn": "attention",
          "mlp.gate_up_proj": "gate_up", "mlp.down_proj": "down", "mlp": "mlp",
          "input_layernorm": "norms", "post_attention_layernorm": "norms"}


def batch1_graph(runner: Any) -> DecodeGraphs:
    """A batch-1 decode graph over the runner's cache, its buffers holding one sequence of
    CONTEXT tokens in blocks 0..CONTEXT/16-1 (filled with random K/V), as the plan stands."""
    bs = runner.block_size
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 1, runner.config.scheduler.max_model_len,
                          bs, runner.device)
    blocks = CONTEXT // bs
    graphs.block_tables[0, :blocks] = torch.arange(blocks, dtype=torch.int32)
    graphs.seq_lens[0], graphs.positions[0], graphs.input_ids[0] = CONTEXT, CONTEXT - 1, 7
    graphs.slot_mapping[0] = CONTEXT - 1
    graphs.capture()
    return graphs


def fill_cache(runner: Any) -> None:
    blocks = CONTEXT // runner.block_size
    for cache in runner.kv_caches:
        cache[:, :blocks].copy_(torch.randn_like(cache[:, :blocks], dtype=torch.float32))


def time_step(graphs: DecodeGraphs, runner: Any, replays: int = 50) -> tuple[float, float]:
    """(graph replay us, eager tail us: lm_head + argmax at batch 1, itself graphed)."""
    from engine.token_choice import argmax

    def tail() -> None:
        argmax(runner.model.compute_logits(graphs.outputs[1], upcast=False))

    graph = graphs.graphs[1]
    graph.replay()
    torch.cuda.synchronize()
    return replays_ms(graph, replays) * 1e3 / replays, graph_us([tail], replays=replays)


def label_hooks(model: torch.nn.Module) -> list[Any]:
    """record_function ranges around each sublayer (by LABELS), removed by the caller."""
    handles = []
    for name, module in model.model.layers.named_modules():
        label = LABELS.get(name.partition(".")[2])  # "3.mlp.down_proj" -> "mlp.down_proj"
        if label is None:
            continue
        ranges: list[Any] = []

        def pre(_m: Any, _a: Any, label: str = label, ranges: list = ranges) -> None:
            ranges.append(torch.profiler.record_function(label))
            ranges[-1].__enter__()

        def post(_m: Any, _a: Any, _o: Any, ranges: list = ranges) -> None:
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def profile_eager(graphs: DecodeGraphs, runner: Any, steps: int = 5) -> dict[str, Any]:
    """Device us per step: per sublayer range and per kernel, eager (kernels back to back)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from engine.token_choice import argmax

    handles = label_hooks(runner.model)
    try:
        graphs._forward(1, False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                hidden = graphs._forward(1, False)
                with record_function("lm_head+argmax"):
                    argmax(runner.model.compute_logits(hidden, upcast=False))
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    names = set(LABELS.values()) | {"lm_head+argmax"}
    ranges: dict[str, float] = defaultdict(float)
    for evt in prof.events():  # the host ranges, each with its kernels' GPU time
        if evt.name in names and evt.device_type == torch.autograd.DeviceType.CPU:
            ranges[evt.name] += _device_us(evt) / steps
    kernels = {evt.key: {"us_per_step": _device_us(evt) / steps,
                         "calls_per_step": evt.count / steps}
               for evt in prof.key_averages()
               if evt.key not in names and evt.device_type == torch.autograd.DeviceType.CUDA}
    return {"ranges_us": dict(ranges), "kernels": kernels}


def _device_us(evt: Any) -> float:
    total = getattr(evt, "device_time_total", None)
    return evt.cuda_time_total if total is None else total


def profile_replay(graphs: DecodeGraphs, replays: int = 20) -> dict[str, Any]:
    """Kernels seen by kineto inside graph replays (if it records them), us per replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.graphs[1].replay()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        dev = _device_us(evt)
        if dev and evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.key] = {"us_per_step": dev / replays, "calls_per_step": evt.count / replays}
    return out
