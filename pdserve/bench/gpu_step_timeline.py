"""The GPU's timeline of batch-1 decode through the whole engine: what a token's wall time holds
besides the decode graph.

NOTE: `llm.generate` of one greedy request under torch.profiler (CUDA activity: every kernel,
graph-replayed ones included, every copy and memset). A kernel launched once per decode step
(the one of the profile closest to the token count) marks steps; over a window of whole
steps in the middle of the request:

    per token:  wall   = window / steps
                busy   = the union of the GPU ops' intervals / steps
                idle   = wall - busy          (the GPU waiting for the host)
    ops:        per name, calls and GPU us per token (copies and memsets included)
    gaps:       the idle intervals, summed per (op before, op after), the largest first

so a token's time outside the graph (the step's inputs copied in, its token copied out, the
host's launches between) shows by name. Used by `python -m pdserve.bench.gpu_decode_profile
--systems ... --timeline`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def step_timeline(llm: Any, prompt: list[int], tokens: int, skip: int = 4) -> dict[str, Any]:
    """Profile one greedy request of `tokens` new tokens; the per-token figures of the NOTE
    over the steps after the first `skip` and before the last two."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    ops = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == DeviceType.CUDA), key=lambda o: o[0])
    return summarize(ops, tokens, skip)


def summarize(ops: list[tuple[float, float, str]], tokens: int, skip: int = 4
              ) -> dict[str, Any]:
    """The NOTE's figures from GPU ops (start us, end us, name) sorted by start."""
    counts = Counter(name for _, _, name in ops)
    marker = min(counts, key=lambda name: (abs(counts[name] - (tokens - 1)), name))
    starts = [s for s, _, name in ops if name == marker]
    if len(starts) < skip + 4:
        raise ValueError(f"{len(starts)} steps marked by {marker!r}: too few to time")
    t0, t1 = starts[skip], starts[-2]
    steps = len(starts) - 2 - skip
    window = [o for o in ops if t0 <= o[0] < t1]
    busy, gaps, end = 0.0, defaultdict(float), t0
    before = "(window start)"
    for s, e, name in window:
        if s > end:
            gaps[(before, name)] += s - end
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, before = e, name
    if t1 > end:  # up to the next step's marker
        gaps[(before, marker)] += t1 - end
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for s, e, name in window:
        per_name[name][0] += 1
        per_name[name][1] += e - s
    wall = (t1 - t0) / steps
    return {
        "marker": marker, "steps": steps, "wall_us": wall, "busy_us": busy / steps,
        "idle_us": wall - busy / steps,
        "ops": {name: {"calls": c / steps, "us": us / steps}
                for name, (c, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])},
        "gaps": [{"before": b, "after": a, "us": us / steps}
                 for (b, a), us in sorted(gaps.items(), key=lambda kv: -kv[1])[:12]],
    }


def format_timeline(name: str, t: dict[str, Any], top: int = 8) -> str:
    lines = [f"{name}: {t['wall_us']:.1f} us a token, GPU busy {t['busy_us']:.1f}, idle "
             f"{t['idle_us']:.1f} ({t['steps']} steps marked by {t['marker'][:40]})"]
    for op, v in list(t["ops"].items())[:top]:
        lines.append(f"  {v['us']:7.1f} us  {v['calls']:5.1f} x  {op[:90]}")
    for g in t["gaps"][:5]:
        lines.append(f"  gap {g['us']:6.1f} us  {g['before'][:40]} -> {g['after'][:40]}")
    return "\n".join(lines)
