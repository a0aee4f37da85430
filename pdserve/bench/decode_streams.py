"""The decode worker's host cost per streamed token: a Generate call per request against one
GenerateStreams call for all of them.

    python -m pdserve.bench.decode_streams [--streams 64] [--tokens 128] [--rounds 5]
        [--device cuda] [--engine-core thread|process]

NOTE: a decode worker writes every running request's new tokens every step. Over Generate that
is a gRPC message per request per step; over GenerateStreams (the gateway's default) one reply
per step for every request on the call (decode_svc/generate_streams.py). This measures what
that costs the worker where it dominates: one `pdserve decode` serving a seeded random Llama of
2 layers and hidden 64 (a cheap forward), `--streams` requests of `--tokens` greedy tokens at
once, prefilled by the worker itself, read as the gateway reads them (gateway/
generate_streams.py for `shared`, a Generate call each for `per-request`). The modes alternate
round by round after one warm-up round of each; reported per round: the decode worker's CPU
seconds (user + system, /proc) per 1000 output tokens and the output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from gateway.generate_streams import GenerateCalls
from pdserve.bench.gpu_model import ModelShape, save_random_model
from pdserve.bench.proc_cpu import children
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.transfer import child, cpu_seconds, wait_serving
from pdserve.cluster.convert import sampling_params_to_pb
from pdserve.cluster.grpc_server import open_channel
from pdserve.ports import free_port
from protos import decode_pb2

VOCAB = 4096
MODES = ("shared", "per-request")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=64, help="requests at once")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens each")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode after warm-up")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="the decode worker's (cuda: its steps replay CUDA graphs)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma list of {','.join(MODES)} (one alone: to profile it)")
    parser.add_argument("--engine-core", default="thread", choices=["thread", "process"],
                        help="the decode worker's engine loop: a thread of its process, or a "
                             "process of its own (then its CPU is reported apart)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default="bench_results/decode_streams.json")


def _worker(model: Path, port: int, args: argparse.Namespace) -> list[str]:
    import sys

    return [sys.executable, "-m", "pdserve.cli", "decode", "--model", str(model), "--port",
            str(port), "--device", args.device, "--dtype", "float32", "--max-model-len", "512",
            "--max-num-seqs", str(args.streams), "--kv-cache-memory", str(64 << 20),
            "--log-level", "warning", "--engine-core", args.engine_core]


async def _round(channel: grpc.aio.Channel, calls: GenerateCalls, pid: int,
                 args: argparse.Namespace, rng: random.Random, tag: str,
                 core_pid: int | None = None) -> dict[str, float]:
    """`--streams` requests at once opened through `calls` (the gateway's, in one mode): the
    worker's CPU seconds per 1000 output tokens (its engine core process's apart) and the
    output tokens/s."""
    from pdserve import SamplingParams

    params = sampling_params_to_pb(
        SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True), args.tokens)

    async def one(i: int) -> int:
        request = decode_pb2.GenerateRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=[rng.randrange(10, VOCAB) for _ in
                                                       range(16)],
            params=params, prefill_locally=True)
        call = calls.open(channel, request, 300)
        tokens = 0
        while (msg := await call.read()) is not grpc.aio.EOF:
            tokens += len(msg.token_ids)
        return tokens

    cpu, core, start = cpu_seconds(pid), cpu_seconds(core_pid), time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(args.streams))))
    wall, used = time.perf_counter() - start, cpu_seconds(pid) - cpu
    return {"tokens": tokens, "cpu_ms_per_1k_tokens": 1e6 * used / tokens,
            "core_cpu_ms_per_1k_tokens": 1e6 * (cpu_seconds(core_pid) - core) / tokens,
            "tok_s": tokens / wall}


async def measure(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, list]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    rng = random.Random(args.seed)
    modes = _modes(args)
    rows: dict[str, list] = {mode: [] for mode in modes}
    with child(_worker(model, port, args), logs / "decode.log") as proc:
        async with open_channel(address) as channel:
            await wait_serving(channel, address, proc, logs / "decode.log", 300)
            core_pid = None
            if args.engine_core == "process":
                (core_pid,) = children(proc.pid, "decode_svc.engine_core")
            calls = {mode: GenerateCalls(shared=mode == "shared") for mode in modes}
            for r in range(args.rounds + 1):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    row = await _round(channel, calls[mode],
                                       proc.pid, args, rng, f"{mode}-{r}", core_pid)
                    core = (f" + engine core {row['core_cpu_ms_per_1k_tokens']:.1f}"
                            if core_pid else "")
                    print(f"round {r} {mode:>11}: decode worker CPU "
                          f"{row['cpu_ms_per_1k_tokens']:.1f}{core} ms per 1000 tokens, "
                          f"{row['tok_s']:.0f} tok/s{' (warm-up)' if r == 0 else ''}",
                          flush=True)
                    if r > 0:
                        rows[mode].append(row)
    return rows


def _modes(args: argparse.Namespace) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"--modes is a comma list of {','.join(MODES)}, got {args.modes!r}")
    return modes


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.rounds < 1 or args.streams < 1 or args.tokens < 2:
        raise ValueError("--rounds and --streams must be >= 1, --tokens >= 2")
    modes = _modes(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shape = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                           intermediate=128, vocab=VOCAB, max_positions=512)
        save_random_model(shape, model, args.seed, device=torch.device("cpu"))
        rows = asyncio.run(measure(args, model, Path(tmp)))
    medians = {mode: {k: statistics.median(r[k] for r in rows[mode])
                      for k in ("cpu_ms_per_1k_tokens", "core_cpu_ms_per_1k_tokens", "tok_s")}
               for mode in modes}
    report = {"config": config_of(args), "rounds": rows, "medians": medians}
    if len(modes) == 2:
        report["cpu_ratio_shared_over_per_request"] = (
            medians["shared"]["cpu_ms_per_1k_tokens"]
            / medians["per-request"]["cpu_ms_per_1k_tokens"])
    for mode in modes:
        print(f"median {mode:>11}: {medians[mode]['cpu_ms_per_1k_tokens']:.1f} CPU ms per 1000 "
              f"tokens (engine core process: {medians[mode]['core_cpu_ms_per_1k_tokens']:.1f}), "
              f"{medians[mode]['tok_s']:.0f} tok/s")
    if len(modes) == 2:
        print("shared / per-request CPU per token: "
              f"{report['cpu_ratio_shared_over_per_request']:.2f}")
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("decode_streams", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
