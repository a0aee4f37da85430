"""Why W1 throughput runs differ: each run's steps, device waits, Triton compiles and GC pauses.

    PYTHONPATH=. python -m pdserve.bench.gpu_throughput_trace [--runs 4] [--small] [--json PATH]

Loads the 1B-shaped random model with the arguments of `pdserve bench gpu` (`--quantization fp8`:
quantized on load), warms it up the same way (gpu_generation._run_pdserve), then runs the
throughput workload `--runs` times, each on fresh prompts, recording every engine step without
adding a synchronisation (steps overlap as in the benchmark):

    step_s      wall time of `engine.step()`
    wait_s      the part of it spent in `LaunchedStep.result()`: waiting for the device's tokens
                (large: device-bound; small: the host is the bottleneck)
    compile_s   Triton compiles inside the step (knobs.runtime's jit hooks: a cache miss's start
                to its end), with the kernels' names
    gc_s        Python's garbage collector inside the step (gc.callbacks), by generation
    prefill     prompt tokens scheduled in the step; decodes: single-token rows
    phases_s    host phases of the step, each a wrapper's wall time (no synchronisation):
                schedule, forward, result, update_from_output, outputs one after another, and
                pack_step, step_tensors, compute_logits, sample inside the rest of the launch;
                per run their means over decode steps, "other" the step outside the first five

and per run: its wall time and roofline fraction, the time outside `engine.step()` (the generate
loop's output handling), sums of the above, and its slowest steps. A diagnostic: the hooks
cost a few microseconds a step. `--torch-profile DIR`: the last run's steps 20-79 (decode steps
of ~250 rows) under torch.profiler too (engine/step_profiler.py: GPU busy time, top kernels;
DIR/offline-<pid>.summary.json), that run's figures then slowed by the profiler.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.step_profiler import StepProfiler
from pdserve.bench.gpu import _llm_kwargs, resolve_sizes
from pdserve.bench.gpu_generation import _greedy
from pdserve.bench.gpu_kernels import measure_ceilings
from pdserve.bench.gpu_model import BF16_BYTES, RandomModel, log, roofline
from pdserve.bench.throughput import make_workload


@dataclass
class Step:
    start_s: float = 0.0
    step_s: float = 0.0
    wait_s: float = 0.0
    compile_s: float = 0.0
    gc_s: float = 0.0
    prefill: int = 0
    decodes: int = 0
    compiled: list[str] = field(default_factory=list)
    phases_s: dict[str, float] = field(default_factory=dict)


class Recorder:
    """Hooks into one engine: steps, device waits, Triton compiles and GC pauses."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.steps, self.current = engine, [], Step()
        self.profiler: StepProfiler | None = None  # torch.profiler over some steps, if set
        self.gc_by_gen: dict[int, list[float]] = {}
        self._gc_start = self._compile_start = 0.0

    def install(self) -> None:
        import engine.model_runner as model_runner

        step, schedule = self.engine.step, self.engine.scheduler.schedule
        result = model_runner.LaunchedStep.result

        def timed_step():
            self.current = Step(start_s=time.perf_counter())
            out = step() if self.profiler is None else self.profiler.step(step)
            self.current.step_s = time.perf_counter() - self.current.start_s
            self.steps.append(self.current)
            return out

        def scheduled():
            out = schedule()
            for s in out.scheduled:
                if s.start < s.request.num_prompt_tokens:
                    self.current.prefill += s.num_new_tokens
                else:
                    self.current.decodes += 1
            return out

        def waited(launched):
            start = time.perf_counter()
            out = result(launched)
            self.current.wait_s += time.perf_counter() - start
            return out

        self.engine.step, self.engine.scheduler.schedule = timed_step, scheduled
        model_runner.LaunchedStep.result = waited
        runner = self.engine.runner
        for owner, name in ((self.engine.scheduler, "schedule"), (model_runner, "pack_step"),
                            (model_runner, "step_tensors"), (runner, "_forward"),
                            (runner.model, "compute_logits"), (runner.sampler, "sample"),
                            (model_runner.LaunchedStep, "result"),
                            (self.engine.scheduler, "update_from_output"),
                            (self.engine, "_outputs")):
            setattr(owner, name, self._phase(name.strip("_"), getattr(owner, name)))
        gc.callbacks.append(self._on_gc)
        _set_triton_hooks(self._on_compile_start, self._on_compile_end)

    def _phase(self, name: str, fn: Any) -> Any:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases = self.current.phases_s
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return timed

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        seconds = time.perf_counter() - self._gc_start
        self.current.gc_s += seconds
        self.gc_by_gen.setdefault(info["generation"], []).append(seconds)

    def _on_compile_start(self, **_: Any) -> None:
        self._compile_start = time.perf_counter()

    def _on_compile_end(self, **kwargs: Any) -> None:
        self.current.compile_s += time.perf_counter() - self._compile_start
        fn = kwargs.get("fn")
        self.current.compiled.append(getattr(getattr(fn, "fn", fn), "__name__", str(fn)))

    def take(self) -> tuple[list[Step], dict[int, list[float]]]:
        steps, gcs = self.steps, self.gc_by_gen
        self.steps, self.gc_by_gen = [], {}
        return steps, gcs


def _set_triton_hooks(start: Any, end: Any) -> None:
    """Triton's compile hooks (triton.knobs, 3.4+); without them compiles go unrecorded."""
    try:
        from triton import knobs
    except ImportError:
        log("trace: no triton.knobs: compiles are not recorded")
        return
    knobs.runtime.jit_cache_hook = lambda **kw: start(**kw)  # None: compile as usual
    knobs.runtime.jit_post_compile_hook = end


def summarize_run(steps: list[Step], gcs: dict[int, list[float]], wall_s: float,
                  output_tokens: int, roof_tok_s: float | None, slowest: int) -> dict[str, Any]:
    step_s = sum(s.step_s for s in steps)
    prefill_steps = [s for s in steps if s.prefill]
    decode_steps = [s for s in steps if not s.prefill and s.decodes]
    compiled = sorted({name for s in steps for name in s.compiled})
    tok_s = output_tokens / wall_s
    return {
        "wall_s": wall_s, "output_tokens_per_s": tok_s,
        "roofline_fraction": None if roof_tok_s is None else tok_s / roof_tok_s,
        "steps": len(steps), "step_s": step_s, "outside_steps_s": wall_s - step_s,
        "wait_s": sum(s.wait_s for s in steps),
        "compile_s": sum(s.compile_s for s in steps),
        "compiles": sum(len(s.compiled) for s in steps), "compiled_kernels": compiled,
        "gc_s": sum(s.gc_s for s in steps),
        "gc": {str(g): {"count": len(v), "s": sum(v)} for g, v in sorted(gcs.items())},
        "prefill_steps": {"count": len(prefill_steps), "s": sum(s.step_s for s in prefill_steps),
                          "tokens": sum(s.prefill for s in prefill_steps)},
        "decode_steps": {"count": len(decode_steps), "s": sum(s.step_s for s in decode_steps),
                         "wait_s": sum(s.wait_s for s in decode_steps),
                         "mean_rows": sum(s.decodes for s in decode_steps)
                         / max(1, len(decode_steps)),
                         "phases_ms": _mean_phases_ms(decode_steps)},
        "slowest": [asdict(s) for s in sorted(steps, key=lambda s: -s.step_s)[:slowest]],
    }


def _mean_phases_ms(steps: list[Step]) -> dict[str, float]:
    """Each phase's mean milliseconds per step, and the step's time outside them ("other")."""
    totals: dict[str, float] = {}
    for s in steps:
        for name, seconds in s.phases_s.items():
            totals[name] = totals.get(name, 0.0) + seconds
    n = max(1, len(steps))
    means = {name: 1e3 * seconds / n for name, seconds in sorted(totals.items())}
    means["other"] = 1e3 * sum(s.step_s for s in steps) / n - sum(
        v for k, v in means.items() if k not in ("pack_step", "step_tensors", "compute_logits",
                                                 "sample"))  # these run inside others
    return {k: round(v, 3) for k, v in means.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    _, sizes = resolve_sizes(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceilings = measure_ceilings(device, torch.bfloat16, resolve_sizes(args)[0]) \
        if device.type == "cuda" else None
    kwargs = _llm_kwargs(args, device, sizes)
    if args.quantization:
        kwargs["quantization"] = args.quantization
    models = RandomModel(sizes, device, args.seed, args.model_dir, kwargs)
    try:
        llm = models.llm()
        tok = llm.get_tokenizer()
        warm = make_workload(tok, min(sizes.max_num_seqs, sizes.num_requests),
                             sizes.input_len_range, (4, 4), args.seed + 1)
        llm.generate([{"prompt_token_ids": p} for p in warm.prompts], _greedy(4), use_tqdm=False)
        recorder = Recorder(llm.llm_engine)
        recorder.install()
        recorder.take()
        runs = []
        for index in range(args.runs):
            if args.torch_profile and index == args.runs - 1:
                recorder.profiler = StepProfiler(args.torch_profile, "offline", skip=20, count=60)
            workload = make_workload(tok, sizes.num_requests, sizes.input_len_range,
                                     (sizes.output_len, sizes.output_len), args.seed + 100 + index)
            prompts = [{"prompt_token_ids": p} for p in workload.prompts]
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, _greedy(sizes.output_len), use_tqdm=False)
            wall = time.perf_counter() - start
            if recorder.profiler is not None:
                recorder.profiler.idle()  # a window cut short by the run's end ends here
            roof = None if ceilings is None else \
                roofline(sizes.shape, workload, BF16_BYTES, ceilings)["output_tokens_per_s"]
            runs.append(summarize_run(*recorder.take(), wall, workload.output_tokens, roof,
                                      args.slowest))
            log(format_run(index, runs[-1]))
    finally:
        models.remove()
    return {"ceilings": ceilings, "runs": runs}


def format_run(index: int, r: dict[str, Any]) -> str:
    frac = "" if r["roofline_fraction"] is None else f" ({r['roofline_fraction']:.3f} of roof)"
    lines = [
        f"run {index + 1}: {r['wall_s']:.3f} s, {r['output_tokens_per_s']:.0f} tok/s{frac}; "
        f"{r['steps']} steps {r['step_s']:.3f} s (outside {r['outside_steps_s']:.3f}); "
        f"device wait {r['wait_s']:.3f}; compiles {r['compiles']} {r['compile_s']:.3f} s "
        f"{r['compiled_kernels']}; gc {r['gc_s'] * 1e3:.1f} ms {r['gc']}",
        f"  prefill steps {r['prefill_steps']}; decode steps {r['decode_steps']}",
    ]
    for s in r["slowest"]:
        lines.append(f"  slow step {s['step_s'] * 1e3:.1f} ms: wait {s['wait_s'] * 1e3:.1f} "
                     f"compile {s['compile_s'] * 1e3:.1f} gc {s['gc_s'] * 1e3:.1f} prefill "
                     f"{s['prefill']} decodes {s['decodes']} {s['compiled']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench.gpu import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--slowest", type=int, default=5)
    parser.add_argument("--quantization", default=None,
                        help="the LLM's quantization (fp8 quantizes the bf16 model on load)")
    parser.add_argument("--torch-profile", default=None, metavar="DIR",
                        help="profile the last run's steps 20-79 with torch.profiler into DIR")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
