"""The timed cases of `pdserve bench transfer` (pdserve/bench/transfer.py) and its report: each
case's timings, ratios paired round by round against a ceiling, a push's parts, the table."""

from __future__ import annotations

import os
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

GIB, MIB = 1 << 30, 1 << 20


# ---- cases, timed in interleaved rounds ---------------------------------------------------------
@dataclass
class Case:
    """One thing to time: `once()` does it and returns the seconds of its timed part."""

    name: str
    nbytes: int
    once: Callable[[], Awaitable[float]]
    seconds: list[float] = field(default_factory=list)
    # a data-plane push's writes, and any push's commit sent to its reply: seconds per call of
    # `once`, the warm-up's first
    write_seconds: list[float] = field(default_factory=list)
    commit_to_reply: list[float] = field(default_factory=list)
    handover: list[tuple[float, float]] = field(default_factory=list)  # (handover, step) s
    # with PDSERVE_HANDOVER_TRACE=1: each push's (request id, commit sent), and from the decode
    # worker's stamps the seconds from the commit sent to the request's first step
    commits: list[tuple[str, float]] = field(default_factory=list)
    to_batch: list[float] = field(default_factory=list)
    # pushes at once: CPU seconds per push while they ran, this process's (the sending side)
    # and the decode worker's, each call of `once`
    cpu_sender: list[float] = field(default_factory=list)
    cpu_decode: list[float] = field(default_factory=list)


async def run_rounds(cases: list[Case], repeats: int) -> None:
    """An untimed warm-up round, then `repeats` rounds of every case in turn."""
    for case in cases:
        await case.once()
    for _ in range(repeats):
        for case in cases:
            case.seconds.append(await case.once())


def summarize(case: Case) -> dict[str, Any]:
    """Median and best of a case's timings."""
    median = statistics.median(case.seconds)
    return {"bytes": case.nbytes, "seconds": case.seconds, "median_s": median,
            "gib_per_s": case.nbytes / median / GIB,
            "best_gib_per_s": case.nbytes / min(case.seconds) / GIB}


def paired_ratio(case: Case, ceiling: Case) -> float:
    """Median over rounds of the case's throughput over the ceiling's in the same round."""
    return statistics.median(
        (case.nbytes / s) / (ceiling.nbytes / c)
        for s, c in zip(case.seconds, ceiling.seconds, strict=True))


def push_report(key: tuple[int, str, int], cases: list[Case], ceiling: Case, same_size: Case,
                copies: list[Case] | None) -> dict[str, Any]:
    """One (tokens, transport, slab size): the push, its ratios to raw grpcio and to the
    device copy; for grpc the serialization alone and the rest (`wire`)."""
    tokens, transport, slab_mib = key
    push = cases[0]
    p = summarize(push)
    out: dict[str, Any] = {
        "num_tokens": tokens, "transport": transport, "slab_bytes": slab_mib * MIB, "push": p,
        "ratio_to_raw": paired_ratio(push, ceiling),
        "ratio_to_raw_same_size": paired_ratio(push, same_size)}
    if copies is not None:
        out["ratio_to_copy"] = paired_ratio(push, copies[0])
        out["ratio_to_scatter"] = paired_ratio(push, copies[1])
    if push.commit_to_reply:  # the decode worker committing the request, and the reply's trip
        out["commit_to_reply_s"] = statistics.median(push.commit_to_reply[-len(push.seconds):])
    if push.handover:  # the commit sent -> the request in the decode batch, against a step
        handed = push.handover[-len(push.seconds):]
        out["handover_s"] = statistics.median(h for h, _ in handed)
        out["decode_step_s"] = statistics.median(s for _, s in handed)
    if push.to_batch:  # traced: the commit sent -> the request scheduled into a decode step
        out["to_batch_s"] = statistics.median(push.to_batch)
    if push.write_seconds:  # the data plane's writes alone, and what the rest of a push took
        writes = push.write_seconds[-len(push.seconds):]
        write = Case(f"write {transport}", push.nbytes, push.once, writes)
        out["write"] = summarize(write)
        out["control_s"] = statistics.median(p - w for p, w in zip(push.seconds, writes))
        if copies is not None:
            out["write_ratio_to_copy"] = paired_ratio(write, copies[0])
            out["write_ratio_to_scatter"] = paired_ratio(write, copies[1])
    if len(cases) > 1:
        ser = summarize(cases[1])
        wire_s = max(p["median_s"] - ser["median_s"], 1e-9)
        out.update(serialize=ser, wire_s=wire_s, wire_gib_per_s=push.nbytes / wire_s / GIB,
                   serialize_share=ser["median_s"] / p["median_s"])
    return out


def concurrent_report(key: tuple[int, str, int], case: Case, n: int,
                      copies: list[Case] | None) -> dict[str, Any]:
    """`n` pushes at once of one (tokens, transport, slab size): their bytes over the time from
    the first send to the last reply, and that over the device copy's rate."""
    tokens, transport, slab_mib = key
    out: dict[str, Any] = {"num_tokens": tokens, "transport": transport,
                           "slab_bytes": slab_mib * MIB, "concurrency": n, "push": summarize(case)}
    if copies is not None:
        out["ratio_to_copy"] = paired_ratio(case, copies[0])
    if len(case.cpu_sender) > 1:  # the warm-up's first: left out
        out["cpu_ms_per_push"] = {"sender": 1e3 * statistics.median(case.cpu_sender[1:]),
                                  "decode": 1e3 * statistics.median(case.cpu_decode[1:])}
    return out


def environment() -> dict[str, Any]:
    env = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "torch_version": torch.__version__, "grpcio_version": grpc.__version__,
           "load_avg_1m_at_start": os.getloadavg()[0]}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def format_table(report: dict[str, Any]) -> str:
    """The report as a readable text table."""
    raw = report["raw"]
    load = report["environment"]["load_avg_1m_at_start"]
    sizes = ", ".join(f"{w['num_tokens']} tokens = {w['kv_bytes'] / MIB:.1f} MiB"
                      for w in report["workload"])
    lines = [
        f"KV per request: {sizes}; {report['config']['repeats']} rounds | load average "
        f"{load:.1f}",
        f"raw grpcio ceiling, {raw['chunk_bytes'] // MIB} MiB messages: {raw['gib_per_s']:.2f} "
        f"GiB/s (best {raw['best_gib_per_s']:.2f})",
    ]
    for c in report["copy"]:
        lines.append(f"device copy, {c['num_tokens']} tokens: {c['copy']['gib_per_s']:.1f} GiB/s "
                     f"contiguous, {c['scatter']['gib_per_s']:.1f} GiB/s as a block scatter")
    lines.append(f"{'tokens':>7} {'transport':<9}{'MiB':>4}{'push GiB/s':>11}{'best':>7}"
                 f"{'push ms':>9}{'/raw':>6}{'/copy':>7}{'serial. GiB/s':>14}"
                 f"{'write GiB/s':>12}{'/copy':>7}{'rest ms':>8}{'c->r ms':>8}{'hand ms':>8}"
                 f"{'step ms':>8}{'batch ms':>9}")
    for s in report["pdserve"]:
        p = s["push"]
        ser = f"{s['serialize']['gib_per_s']:>14.2f}" if "serialize" in s else f"{'-':>14}"
        copy = f"{s['ratio_to_copy']:>7.3f}" if "ratio_to_copy" in s else f"{'-':>7}"
        write = f"{'-':>12}{'-':>7}{'-':>8}"
        if "write" in s:
            w_copy = s.get("write_ratio_to_copy")
            write = (f"{s['write']['gib_per_s']:>12.2f}"
                     + (f"{w_copy:>7.3f}" if w_copy is not None else f"{'-':>7}")
                     + f"{1e3 * s['control_s']:>8.2f}")
        lines.append(
            f"{s['num_tokens']:>7} {s['transport']:<9}{s['slab_bytes'] // MIB:>4}"
            f"{p['gib_per_s']:>11.2f}{p['best_gib_per_s']:>7.2f}{1e3 * p['median_s']:>9.2f}"
            f"{s['ratio_to_raw']:>6.2f}{copy}{ser}{write}"
            f"{1e3 * s.get('commit_to_reply_s', float('nan')):>8.2f}"
            f"{1e3 * s.get('handover_s', float('nan')):>8.2f}"
            f"{1e3 * s.get('decode_step_s', float('nan')):>8.2f}"
            f"{1e3 * s.get('to_batch_s', float('nan')):>9.2f}")
    for s in report.get("concurrent", []):
        p = s["push"]
        copy = f", {s['ratio_to_copy']:.3f} of the copy" if "ratio_to_copy" in s else ""
        lines.append(f"{s['concurrency']} pushes at once, {s['num_tokens']} tokens each, "
                     f"{s['transport']} {s['slab_bytes'] // MIB} MiB: {p['gib_per_s']:.2f} GiB/s "
                     f"(best {p['best_gib_per_s']:.2f}), {1e3 * p['median_s']:.2f} ms{copy}"
                     + ("; CPU ms a push: sender {sender:.2f}, decode worker {decode:.2f}".format(
                         **s["cpu_ms_per_push"]) if "cpu_ms_per_push" in s else ""))
    return "\n".join(lines)
