"""Where a batch-1 decode step of the random Llama-3.2-1B shape spends its GPU time (H100).

    PYTHONPATH=. python -m pdserve.bench.gpu_decode_profile [--out DIR] [--no-sweep]

NOTE: one LLM (bf16, CUDA graphs, the decode GEMV plan made at load: engine/models/gemv_plan.py)
on a random model built by pdserve/bench/gpu_model.py. Then, in this one process:
  1. ceilings: a 1 GiB device copy (bytes read + written per second, as `--parts ceilings`).
  2. GEMMs: each projection shape of the model at M = 1, 2, 4 tokens, every layer's weight in
     turn from a CUDA graph (DRAM, not L2): cuBLAS (F.linear) against a sweep of the GEMV's
     tiles at M = 1 (kernels/gemv.py); silu_and_mul + down against kernels/gemv_silu.py; norm
     + projection against kernels/gemv_rmsnorm.py; each as weight bytes / time, and that over
     the copy rate. The plan the load made (and its timings) comes first.
  3. the step: a batch-1 decode graph (context 256) captured twice, with the plan and without
     it (cuBLAS + separate SiLU, as before), replays alternated and timed; the eager tail (lm_head,
     argmax) likewise; torch.profiler over eager steps with one range per sublayer (module
     hooks) and per kernel; greedy tokens and first-step logits with against without.
Tables print last; everything goes to DIR/decode_profile.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.models.gemv_plan import (
    NORM_ROWS,
    _linear_calls,
    _norm_calls,
    _normed_weights,
    _silu_calls,
    _time_us,
    clear_decode_gemv,
)
from kernels.gemv import GemvBlocks
from pdserve.bench.gpu_model import ModelShape, log, save_random_model

SWEEP: dict[int, tuple[GemvBlocks, ...]] = {
    1: tuple(GemvBlocks(*b) for b in [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (4, 2048, 8),
                                      (8, 256, 4), (8, 512, 8), (16, 256, 8), (16, 128, 4),
                                      (2, 2048, 8)]),
    2: tuple(GemvBlocks(*b) for b in [(4, 512, 4), (4, 256, 4), (8, 256, 4), (8, 256, 8),
                                      (2, 1024, 8), (4, 1024, 8)]),
    4: tuple(GemvBlocks(*b) for b in [(4, 256, 4), (2, 512, 4), (8, 256, 8), (4, 512, 8),
                                      (8, 128, 4), (2, 1024, 8)]),
}
SILU_SWEEP = {1: SWEEP[1][:2] + SWEEP[1][4:6] + SWEEP[1][8:], 2: SWEEP[2][:3], 4: SWEEP[4][:3]}
CONTEXT = 256  # tokens in the cache at the profiled step (the latency bench's 128 + up to 256)
LABELS = {"self_attn.qkv_proj": "qkv", "self_attn.o_proj": "o_proj", "self_attn": "attention",
          "mlp.gate_up_proj": "gate_up", "mlp.down_proj": "down", "mlp": "mlp",
          "input_layernorm": "norms", "post_attention_layernorm": "norms"}


def copy_rate(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device copy (the bench's ceiling)."""
    from pdserve.bench.gpu_kernels import _copy_ms

    return 2 * (1 << 30) / (_copy_ms(1 << 30, device) * 1e-3)


def shapes_of(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    layers = model.model.layers
    return {"qkv": [lyr.self_attn.qkv_proj.weight for lyr in layers],
            "o_proj": [lyr.self_attn.o_proj.weight for lyr in layers],
            "gate_up": [lyr.mlp.gate_up_proj.weight for lyr in layers],
            "down": [lyr.mlp.down_proj.weight for lyr in layers],
            "lm_head": [model.model.embed_tokens.weight]}


def sweep_gemms(model: torch.nn.Module, rate: float, sweep: bool) -> list[dict[str, Any]]:
    """Per shape and M: cuBLAS and every swept tile, microseconds per call."""
    rows, normed = [], _normed_weights(model)
    for name, weights in shapes_of(model).items():
        nbytes = weights[0].nbytes
        for m in (1, 2, 4):
            row: dict[str, Any] = {"shape": name, "n_k": tuple(weights[0].shape), "m": m,
                                   "bytes": nbytes, "cublas_us": _time_us(
                                       _linear_calls(weights, m, None))}
            tiles = SWEEP[m] if sweep and m == 1 else ()  # cuBLAS won M = 2, 4 by far
            row["gemv_us"] = {str(tuple(b)): _time_us(fns) for b in tiles
                              if (fns := _linear_calls(weights, m, b))}
            if name == "down":
                row["silu_down_us"] = _time_us(_silu_calls(weights, m, None))
                row["gemv_silu_us"] = {str(tuple(b)): _time_us(_silu_calls(weights, m, b))
                                       for b in (SILU_SWEEP[m] if sweep and m == 1 else ())}
            pairs = normed.get(tuple(weights[0].shape))
            if pairs and m == 1 and name in ("qkv", "gate_up"):
                k = weights[0].shape[1]
                row["norm_linear_us"] = _time_us(_norm_calls(pairs, m, None))
                row["gemv_norm_us"] = {str((bn, k, wp)): _time_us(_norm_calls(
                    pairs, m, GemvBlocks(bn, k, wp))) for bn, wp in (NORM_ROWS if sweep else ())}
            row["cublas_frac"] = nbytes / (row["cublas_us"] * 1e-6) / rate
            if row["gemv_us"]:
                best = min(row["gemv_us"], key=row["gemv_us"].get)
                row.update(best_tile=best, best_us=row["gemv_us"][best],
                           best_frac=nbytes / (row["gemv_us"][best] * 1e-6) / rate)
            log(f"  {name} M{m}: cublas {row['cublas_us']:.1f} us, best "
                f"{row.get('best_tile')} {row.get('best_us', float('nan')):.1f} us")
            rows.append(row)
    return rows


# ---- the step ------------------------------------------------------------------------------
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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays, _time_us([tail], replays=replays)


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


def greedy_tokens(llm: Any, prompt: list[int], n: int) -> list[int]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


# ---- the run -------------------------------------------------------------------------------------
class Plans:
    """The load-time plan of every weight, to switch the model between it and none."""

    KINDS = ("gemv_plan", "gemv_silu_plan", "gemv_norm_plan", "gemv_norm_silu_plan")

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.saved = {p: {k: p.__dict__[k] for k in self.KINDS if k in p.__dict__}
                      for p in model.parameters()}

    def use(self, on: bool) -> None:
        clear_decode_gemv(self.model)
        for p, plans in self.saved.items():
            for kind, plan in plans.items():
                if on:
                    setattr(p, kind, plan)

    def choices(self) -> dict[str, Any]:
        out = {}
        for name, weights in shapes_of(self.model).items():
            for kind, plan in self.saved[weights[0]].items():
                out[f"{name} {kind}"] = [(m, b and tuple(b)) for m, b in plan.by_tokens]
        return out


def compare_outputs(llm: Any, runner: Any, plans: Plans, graphs: dict[bool, DecodeGraphs],
                    tokens: int) -> dict[str, Any]:
    """First-step logits of both graphs, and greedy tokens of one request, with against without."""
    logits = {}
    for on in (True, False):
        plans.use(on)
        graphs[on].graphs[1].replay()
        logits[on] = runner.model.compute_logits(graphs[on].outputs[1], upcast=True)[0].double()
    top2 = logits[False].topk(2).values
    out: dict[str, Any] = {
        "logits_rel_err": ((logits[True] - logits[False]).norm() / logits[False].norm()).item(),
        "logits_max_abs_diff": (logits[True] - logits[False]).abs().max().item(),
        "argmax_equal": bool(logits[True].argmax() == logits[False].argmax()),
        "top2_margin": (top2[0] - top2[1]).item()}
    prompt = [(17 * i + 3) % 120000 for i in range(128)]
    seqs, loaded = {}, runner.graphs
    try:
        for on in (True, False):
            plans.use(on)
            runner.graphs = loaded if on else graphs[False]
            seqs[on] = greedy_tokens(llm, prompt, tokens)
    finally:
        runner.graphs = loaded
        plans.use(True)
    same = next((i for i, (a, b) in enumerate(zip(seqs[True], seqs[False])) if a != b), tokens)
    out.update(tokens=tokens, tokens_equal_prefix=same, tokens_equal=seqs[True] == seqs[False])
    return out


@torch.inference_mode()
def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The NOTE's steps; the report so far is rewritten to out/decode_profile.json after each."""
    from pdserve import LLM

    device = torch.device("cuda")
    folder = Path(args.model_dir or tempfile.mkdtemp(prefix="pdserve-profile-"))
    if not (folder / "config.json").is_file():
        log(f"building the random model in {folder}")
        save_random_model(ModelShape(), folder, args.seed, device)
    llm = LLM(model=str(folder), dtype="bfloat16", device="cuda", max_num_seqs=4,
              kv_cache_memory=4 << 30, seed=args.seed)
    runner = llm.llm_engine.runner
    plans = Plans(runner.model)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "plan": plans.choices(),
                              "plan_timings": getattr(runner.model, "decode_gemv_report", None)}

    def save() -> None:
        (out / "decode_profile.json").write_text(json.dumps(report, indent=1, default=str))

    log(f"plan: {json.dumps(report['plan'])}\n{json.dumps(report['plan_timings'], indent=1)}")
    rate = report["copy_bytes_per_s"] = copy_rate(device)
    save()
    log("== GEMM sweep")
    report["gemms"] = sweep_gemms(runner.model, rate, not args.no_sweep)
    save()
    fill_cache(runner)
    graphs = {}
    for on in (True, False):
        plans.use(on)
        graphs[on] = batch1_graph(runner)
    log("== step timing")
    samples: dict[bool, list[tuple[float, float]]] = defaultdict(list)
    for _ in range(5):
        for on in (True, False):
            plans.use(on)
            samples[on].append(time_step(graphs[on], runner))
    report["step"] = {("gemv" if on else "cublas"): {
        "replay_us": statistics.median(r for r, _ in s),
        "tail_us": statistics.median(t for _, t in s), "samples": s} for on, s in samples.items()}
    log(f"step: {report['step']}")
    save()
    log("== profiles")
    for on in (True, False):
        plans.use(on)
        name = "gemv" if on else "cublas"
        report[f"eager_{name}"] = profile_eager(graphs[on], runner)
        report[f"replay_{name}"] = profile_replay(graphs[on])
        save()
    log("== outputs")
    report["outputs"] = compare_outputs(llm, runner, plans, graphs, args.tokens)
    return report


def format_tables(r: dict[str, Any]) -> str:
    rate, nan = r["copy_bytes_per_s"], float("nan")
    lines = [f"decode profile | {r['gpu']} | copy {rate / 1e12:.2f} TB/s", f"plan: {r['plan']}",
             "", f"{'shape':<8}{'M':>2}{'MB':>7}{'cuBLAS us':>10}{'frac':>6}  {'best tile':<16}"
             f"{'us':>7}{'frac':>6}{'speedup':>8}"]
    for g in r["gemms"]:
        lines.append(f"{g['shape']:<8}{g['m']:>2}{g['bytes'] / 1e6:>7.1f}{g['cublas_us']:>10.1f}"
                     f"{g['cublas_frac']:>6.2f}  {g.get('best_tile', '-'):<16}"
                     f"{g.get('best_us', nan):>7.1f}{g.get('best_frac', nan):>6.2f}"
                     f"{g['cublas_us'] / g.get('best_us', nan):>8.2f}")
        for fused, base, what in (("gemv_silu_us", "silu_down_us", "silu+down"),
                                  ("gemv_norm_us", "norm_linear_us", "norm+linear")):
            if g.get(fused):
                best = min(g[fused], key=g[fused].get)
                lines.append(f"{'  ' + what + ' (planned) ' + format(g[base], '.1f'):<33} "
                             f"fused {best:<16}{g[fused][best]:>7.1f}")
        if g["m"] == 1 and g["gemv_us"]:
            lines.append("    M1 tiles: " + ", ".join(f"{t} {us:.1f}" for t, us in
                                                      sorted(g["gemv_us"].items())))
    s = r["step"]
    lines += ["", "step (us): " + " | ".join(
        f"{k}: replay {v['replay_us']:.1f} + lm_head/argmax {v['tail_us']:.1f} = "
        f"{v['replay_us'] + v['tail_us']:.1f}" for k, v in s.items())]
    eg, ec = r["eager_gemv"]["ranges_us"], r["eager_cublas"]["ranges_us"]
    lines.append("eager device us per step, gemv | cublas: " + ", ".join(
        f"{k} {eg.get(k, 0):.0f} | {ec.get(k, 0):.0f}" for k in sorted(set(eg) | set(ec))))
    for name in ("gemv", "cublas"):
        for kind in ("eager", "replay"):
            ks = r[f"{kind}_{name}"] if kind == "replay" else r[f"eager_{name}"]["kernels"]
            total = sum(v["us_per_step"] for v in ks.values())
            lines.append(f"\n{kind} kernels, {name}: {total:.0f} us/step, "
                         f"{sum(v['calls_per_step'] for v in ks.values()):.0f} launches")
            for key, v in sorted(ks.items(), key=lambda kv: -kv[1]["us_per_step"])[:14]:
                lines.append(f"  {v['us_per_step']:>7.1f} us {v['calls_per_step']:>5.0f}x  "
                             f"{key[:90]}")
    lines.append(f"\noutputs: {r['outputs']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="folder for decode_profile.json ($OUT)")
    parser.add_argument("--model-dir", default=None, help="reuse or keep the random model here")
    parser.add_argument("--no-sweep", action="store_true", help="cuBLAS only, no tile sweep")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens to compare")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    report = run(args, out)
    (out / "decode_profile.json").write_text(json.dumps(report, indent=1, default=str))
    print(format_tables(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
