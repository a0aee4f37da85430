"""The prefill worker's host cost per prompt under a burst of prompts.

    python -m pdserve.bench.prefill_burst [--layers 16] [--prompts 48] [--rounds 4]
        [--input-len 128-512] [--transport nixl] [--engine-core thread|process]

NOTE: at saturation a split cluster's first tokens wait for the prefill worker's steps, and on
a GPU those steps were mostly host time (docs/loadtest.md). This measures that host time per
prompt where it dominates: one `pdserve prefill` and one `pdserve decode` (the KV over
`--transport`; nixl moves it between host memory on a CPU box) serving a seeded random Llama of
`--layers` layers and hidden 64, so the forward is cheap and what the worker spends per prompt
(the engine's bookkeeping, the KV progress notes, the push's writes and control plane, the
Prefill rpc) is most of the figure. Per round: `--prompts` requests reserved on the decode
worker (Generate up to its first message, as the gateway does), then their Prefill rpcs all at
once; reported: the round's wall time to the last first token and to the last second token
(every push committed) and the prefill worker's CPU seconds (user + system, /proc; its engine
core process's too) per prompt. The first round warms up and is left out.

With PDSERVE_STACK_SAMPLES=DIR and PDSERVE_STACK_SAMPLE_WHILE=PATH set (engine/stack_sampler.py)
both workers sample their threads' stacks and CPU during the measured bursts only (PATH exists
while their Prefill rpcs run): DIR/prefill-PID.cpu.json says which of the prefill worker's
threads spent that CPU, DIR/prefill-PID.txt where.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from pdserve.bench.gpu_model import ModelShape, save_random_model
from pdserve.bench.gpu_serve import sampling_window
from pdserve.bench.proc_cpu import children
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.throughput import parse_range
from pdserve.bench.transfer import child, cpu_seconds, wait_serving
from pdserve.cluster.convert import sampling_params_to_pb
from pdserve.cluster.grpc_server import open_channel
from pdserve.ports import free_port
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

VOCAB = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of the model")
    parser.add_argument("--prompts", type=int, default=48, help="prompts per burst")
    parser.add_argument("--rounds", type=int, default=4, help="bursts (the first warms up)")
    parser.add_argument("--input-len", type=parse_range, default=(128, 512), metavar="LO-HI",
                        help="prompt tokens, both ends included")
    parser.add_argument("--transport", default="nixl", choices=["grpc", "nixl", "cuda_ipc"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--engine-core", default="thread", choices=["thread", "process"],
                        help="the prefill worker's (pdserve prefill --engine-core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default="bench_results/prefill_burst.json")


def _worker(role: str, model: Path, port: int, args: argparse.Namespace, blocks: int
            ) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", role, "--model", str(model), "--port",
            str(port), "--device", args.device, "--dtype", "float32", "--num-kv-blocks",
            str(blocks), "--max-model-len", "1024", "--max-num-seqs", str(max(64, args.prompts)),
            "--kv-transport", args.transport, "--log-level", "warning",
            *(["--no-prefix-caching"] if role == "decode" else
              ["--engine-core", args.engine_core])]


async def _burst(prefill: Any, decode: Any, decode_address: str, prompts: list[list[int]],
                 pid: int, tag: str, sampled: bool) -> dict[str, float]:
    """Reserve every prompt on the decode worker, then prefill them all at once: the wall
    seconds to the last Prefill reply (`wall_s`) and to the last second token (`second_s`:
    every push committed), the prefill worker's CPU seconds per prompt (its engine core
    process's included). `sampled`: the stack samplers' gate is open while the Prefill rpcs
    run."""
    params = sampling_params_to_pb(_greedy(), 2)
    opened = []
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        call = decode.Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, params=params), timeout=300)
        first = await call.read()
        opened.append((rid, prompt, call, first))
    pids = [pid, *children(pid, "prefill_svc.engine_core")]  # its engine core process too
    cpu, start = sum(map(cpu_seconds, pids)), time.perf_counter()
    seconds = [asyncio.ensure_future(_second_token(call)) for _, _, call, _ in opened]
    with sampling_window(sampled):
        await asyncio.gather(*(prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params,
            decode_address=decode_address, decode_cached_blocks=first.cached_blocks,
            decode_kv_target=first.kv_target if first.HasField("kv_target") else None),
            timeout=300) for rid, prompt, _, first in opened))
    wall, used = time.perf_counter() - start, sum(map(cpu_seconds, pids)) - cpu
    second = max(await asyncio.gather(*seconds)) - start
    return {"wall_s": wall, "second_s": second, "cpu_s_per_prompt": used / len(prompts)}


async def _second_token(call: Any) -> float:
    """When the Generate's second token came (the push committed, a decode step ran)."""
    while (msg := await call.read()) is not grpc.aio.EOF and not msg.finish_reason:
        pass
    return time.perf_counter()


def _greedy() -> Any:
    from pdserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


async def measure(args: argparse.Namespace, model: Path, logs: Path) -> list[dict[str, float]]:
    low, high = args.input_len
    blocks = max(args.prompts * (-(-high // 16) + 1), 1024 // 16) + 16
    pport, dport = free_port(), free_port()
    paddr, daddr = f"127.0.0.1:{pport}", f"127.0.0.1:{dport}"
    rng = random.Random(args.seed)
    rounds = []
    with (child(_worker("prefill", model, pport, args, blocks), logs / "prefill.log") as pproc,
          child(_worker("decode", model, dport, args, blocks), logs / "decode.log") as dproc):
        async with open_channel(paddr) as pch, open_channel(daddr) as dch:
            await wait_serving(pch, paddr, pproc, logs / "prefill.log", 300)
            await wait_serving(dch, daddr, dproc, logs / "decode.log", 300)
            prefill, decode = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
            for r in range(args.rounds):
                prompts = [[rng.randrange(10, VOCAB - 10) for _ in range(rng.randint(low, high))]
                           for _ in range(args.prompts)]
                burst = await _burst(prefill, decode, daddr, prompts, pproc.pid, f"b{r}",
                                     sampled=r > 0)
                print(f"round {r}: {args.prompts} prompts in {burst['wall_s'] * 1e3:.0f} ms "
                      f"(second tokens {burst['second_s'] * 1e3:.0f} ms), prefill worker CPU "
                      f"{burst['cpu_s_per_prompt'] * 1e3:.2f} ms a prompt", flush=True)
                rounds.append(burst)
    return rounds[1:]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.rounds < 2:
        raise ValueError(f"--rounds must be >= 2 (the first warms up), got {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shape = ModelShape(hidden=64, layers=args.layers, heads=4, kv_heads=2, head_dim=16,
                           intermediate=128, vocab=VOCAB, max_positions=1024)
        save_random_model(shape, model, args.seed, device=torch.device("cpu"))
        rounds = asyncio.run(measure(args, model, Path(tmp)))
    report = {"config": config_of(args), "rounds": rounds,
              "median_wall_s": statistics.median(r["wall_s"] for r in rounds),
              "median_second_s": statistics.median(r["second_s"] for r in rounds),
              "median_cpu_ms_per_prompt": 1e3 * statistics.median(
                  r["cpu_s_per_prompt"] for r in rounds)}
    print(f"median: {report['median_wall_s'] * 1e3:.0f} ms a burst (second tokens "
          f"{report['median_second_s'] * 1e3:.0f} ms), "
          f"{report['median_cpu_ms_per_prompt']:.2f} prefill CPU ms a prompt")
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("prefill_burst", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
