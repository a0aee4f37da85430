"""Where a batch-1 decode step of the random Llama-3.2-1B shape spends its GPU time (H100).

    PYTHONPATH=. python -m pdserve.bench.gpu_decode_profile [--out DIR] [--no-sweep]
    PYTHONPATH=. python -m pdserve.bench.gpu_decode_profile --systems bf16,fp8,w4a16 [--out DIR]

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
Steps 2 and 3: pdserve/bench/gpu_decode_gemms.py, gpu_decode_step.py. Tables print last;
everything goes to DIR/decode_profile.json.

With `--systems`: per system of pdserve.bench.gpu_quant (bf16, fp8 quantized on load, w4a16 an
AWQ checkpoint written from the bf16 one, w4a16_fused the same with the norms and SwiGLU in the
GEMV's prologue) only the step: the batch-1 graph's replay and eager
tail timed, and the kernels inside the replay (kineto) against the replay's wall time, so what
the kernels' own time leaves is the launches' gaps. DIR/decode_profile_systems.json. With
`--timeline N` also each system's batch-1 request of N tokens through the engine, profiled:
what a token's wall time holds besides the graph (pdserve/bench/gpu_step_timeline.py).
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
from engine.models.gemv_plan import clear_decode_gemv
from pdserve.bench.gpu_decode_gemms import copy_rate, shapes_of, sweep_gemms
from pdserve.bench.gpu_decode_step import (
    batch1_graph,
    fill_cache,
    profile_eager,
    profile_replay,
    time_step,
)
from pdserve.bench.gpu_model import ModelShape, log, save_random_model


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


@torch.inference_mode()
def run_systems(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """`--systems`: each system's batch-1 step (see the NOTE)."""
    from pdserve.bench.gpu_model import ModelSizes, RandomModel
    from pdserve.bench.gpu_quant import engine_for, serving

    device = torch.device("cuda")
    kwargs: dict[str, Any] = {"dtype": "bfloat16", "max_num_seqs": 4,
                              "kv_cache_memory": 4 << 30}
    base = RandomModel(ModelSizes(), device, args.seed, args.model_dir, kwargs)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "systems": {}}
    for system in args.systems.split(","):
        source = engine_for(system, base, kwargs)
        try:
            with serving(system):
                runner = source.llm().llm_engine.runner
                fill_cache(runner)
                graphs = batch1_graph(runner)
                steps = [time_step(graphs, runner) for _ in range(5)]
                kernels = profile_replay(graphs)
                replay = statistics.median(r for r, _ in steps)
                in_kernels = sum(v["us_per_step"] for v in kernels.values())
                timeline = None
                if args.timeline:
                    from pdserve.bench.gpu_step_timeline import format_timeline, step_timeline

                    timeline = step_timeline(source.llm(), list(range(1000, 1128)),
                                             args.timeline)
                    log(format_timeline(system, timeline))
                report["systems"][system] = {
                    "timeline": timeline,
                    "replay_us": replay, "tail_us": statistics.median(t for _, t in steps),
                    "kernels_us": in_kernels, "gaps_us": replay - in_kernels,
                    "launches": sum(v["calls_per_step"] for v in kernels.values()),
                    "kernels": kernels,
                    "plan": getattr(runner.model, "decode_gemv_report", None)}
                log(f"{system}: replay {replay:.1f} us, kernels {in_kernels:.1f} us")
        finally:
            source.close_llm()
        (out / "decode_profile_systems.json").write_text(json.dumps(report, indent=1))
    return report


def format_systems(r: dict[str, Any]) -> str:
    lines = [f"batch-1 step by system | {r['gpu']}"]
    for name, s in r["systems"].items():
        lines.append(f"\n{name}: replay {s['replay_us']:.1f} us + tail {s['tail_us']:.1f} us; "
                     f"kernels {s['kernels_us']:.1f} us in {s['launches']:.0f} launches, gaps "
                     f"{s['gaps_us']:.1f} us")
        for key, v in sorted(s["kernels"].items(), key=lambda kv: -kv[1]["us_per_step"])[:16]:
            lines.append(f"  {v['us_per_step']:>7.1f} us {v['calls_per_step']:>5.0f}x  {key[:90]}")
        for shape, timed in (s["plan"] or {}).items():
            lines.append(f"  plan {shape}: {timed['choice']} " + ", ".join(
                f"{c} {us:.1f}" if isinstance(us, float) else f"{c} {us}"
                for c, us in timed["us"].items() if c.startswith("M1")))
    return "\n".join(lines)


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
    parser.add_argument("--systems", default=None,
                        help="bf16,fp8,w4a16: only each system's step (see the NOTE)")
    parser.add_argument("--timeline", type=int, default=0, metavar="TOKENS",
                        help="--systems: also each system's GPU timeline through the engine, "
                             "one request of TOKENS (pdserve/bench/gpu_step_timeline.py)")
    args = parser.parse_args(argv)
    out = Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    if args.systems:
        print(format_systems(run_systems(args, out)), flush=True)
        return 0
    report = run(args, out)
    (out / "decode_profile.json").write_text(json.dumps(report, indent=1, default=str))
    print(format_tables(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
