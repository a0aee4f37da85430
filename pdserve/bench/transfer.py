"""KV transfer throughput over gRPC on loopback: pdserve's PushKV path against raw grpcio.

    python -m pdserve.bench.transfer [--kv-mib 256] [--slab-mib 1,4,8] [--repeats 3]

NOTE: three measurements, one run, both ends always in separate processes:

  raw        the ceiling: a grpc.aio client streams N pre-made `--raw-chunk-mib` bytes messages
             (no protobuf) to a trivial grpc.aio sink in a child process that only counts them.
  pdserve    the real path: a real decode worker (`pdserve decode --num-kv-blocks ...`) and, in
             this process, a KV cache shaped like the decode worker's model (default: the
             bundled SmolLM2, 30 layers x 3 kv heads x head dim 64, float32, block 16). Per
             push: open Generate (the worker reserves the blocks and answers an empty message),
             time `GrpcKVSender.send` of the request's (shuffled) blocks until the worker's
             PushKVResponse (every slab written into its cache, the request committed), then read
             Generate to its end so the blocks are freed. Once per `--slab-mib` size.
  serialize  the sender's own cost without a wire: the same push's messages built and
             serialized to the bytes grpc sends, in this process. `wire_s` = push - serialize:
             what the network path (grpc both sides, the receiver's parse and scatter) adds.

GiB/s counts KV payload bytes. Medians over `--repeats` after one untimed warm-up each. CPU
timings on a shared box move with other processes: the report records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from engine.kv_transfer import KVLayout
from engine.sampling_params import SamplingParams
from pdserve.cluster.convert import sampling_params_to_pb
from pdserve.cluster.grpc_server import GRPC_OPTIONS, check_health, open_channel
from pdserve.launcher import free_port
from prefill_svc.sender import GrpcKVSender, KVTransfer
from protos import decode_pb2, decode_pb2_grpc

GIB, MIB = 1 << 30, 1 << 20
RAW_METHOD = "/pdserve.bench.Sink/Push"


def parse_sizes(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8]; ValueError unless every item is a positive integer."""
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes are positive integers separated by commas, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to `parser` (shared by `pdserve bench transfer`)."""
    parser.add_argument("--model", default=None,
                        help="the decode worker's model; its KV layout must match the flags "
                             "below (default: bundled SmolLM2)")
    parser.add_argument("--kv-mib", type=int, default=256, help="KV bytes of the request")
    parser.add_argument("--slab-mib", type=parse_sizes, default=[1, 4, 8], metavar="A,B,..",
                        help="PushKV slab sizes to measure")
    parser.add_argument("--raw-chunk-mib", type=int, default=4, help="raw stream message size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads, this process")
    parser.add_argument("--skip-raw", action="store_true")
    parser.add_argument("--skip-pdserve", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--output-json", default="bench_results/transfer.json")


@dataclass(frozen=True)
class Plan:
    """The request whose KV moves: its layout and size."""

    layout: KVLayout
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.layout.num_layers * self.layout.cell_bytes()

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size


def make_plan(args: argparse.Namespace) -> Plan:
    layout = KVLayout(args.num_layers, args.num_kv_heads, args.head_dim, args.dtype,
                      args.block_size)
    plan = Plan(layout, 1)
    return Plan(layout, max(1, (args.kv_mib * MIB) // plan.block_bytes))


# ---- timing -------------------------------------------------------------------------------------
def summarize(seconds: list[float], nbytes: int) -> dict[str, Any]:
    """Median and best of repeated timings of moving `nbytes`."""
    median = statistics.median(seconds)
    return {"bytes": nbytes, "seconds": seconds, "median_s": median,
            "gib_per_s": nbytes / median / GIB, "best_gib_per_s": nbytes / min(seconds) / GIB}


async def timed(fn: Callable[[], Awaitable[Any]], repeats: int) -> list[float]:
    """Seconds of each of `repeats` awaited calls of `fn`, after one untimed warm-up."""
    await fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        seconds.append(time.perf_counter() - start)
    return seconds


# ---- (a) the raw grpcio ceiling -----------------------------------------------------------------
def serve_raw(port: int) -> None:
    """The raw sink (child process): a grpc.aio server counting the bytes of a client stream."""
    async def push(chunks: AsyncIterator[bytes], context: Any) -> bytes:
        total = 0
        async for chunk in chunks:
            total += len(chunk)
        return total.to_bytes(8, "little")

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            "pdserve.bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def bench_raw(port: int, nbytes: int, chunk: int, repeats: int) -> dict[str, Any]:
    """Stream `nbytes` as pre-made `chunk`-byte messages to the sink; GiB/s per push."""
    messages = [os.urandom(chunk) for _ in range(max(1, nbytes // chunk))]
    total = len(messages) * chunk

    async def stream() -> AsyncIterator[bytes]:
        for m in messages:
            yield m

    async with open_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        push = channel.stream_unary(RAW_METHOD)

        async def once() -> None:
            reply = await push(stream())
            assert int.from_bytes(reply, "little") == total

        seconds = await timed(once, repeats)
    return {"chunk_bytes": chunk, **summarize(seconds, total)}


# ---- (b) pdserve's path: GrpcKVSender -> a real decode worker -----------------------------------
def decode_worker_argv(args: argparse.Namespace, plan: Plan, port: int) -> list[str]:
    """`pdserve decode` with room for one request of the plan's blocks (and a few spare)."""
    model = ["--model", args.model] if args.model else []
    return [
        sys.executable, "-m", "pdserve.cli", "decode", *model, "--port", str(port),
        "--num-kv-blocks", str(plan.num_blocks + 8), "--max-model-len", str(plan.num_tokens + 16),
        "--dtype", args.dtype, "--block-size", str(args.block_size), "--device", "cpu",
        "--no-prefix-caching", "--max-num-seqs", "4", "--log-level", "warning",
    ]


def sender_cache(plan: Plan, spare_blocks: int = 8) -> tuple[list[torch.Tensor], list[int]]:
    """A random KV cache shaped like the decode worker's, and the request's shuffled blocks."""
    lay, total = plan.layout, plan.num_blocks + spare_blocks
    gen = torch.Generator().manual_seed(0)
    shape = (2, total, lay.block_size, lay.num_kv_heads, lay.head_dim)
    caches = [torch.randn(shape, generator=gen).to(lay.torch_dtype)
              for _ in range(lay.num_layers)]
    blocks = torch.randperm(total, generator=gen)[: plan.num_blocks].tolist()
    return caches, blocks


class PushDriver:
    """Drives one decode worker the way the gateway and a prefill worker do, one push at a time."""

    def __init__(self, address: str, plan: Plan, caches: list[torch.Tensor], blocks: list[int]):
        self.address, self.plan, self.caches, self.blocks = address, plan, caches, blocks
        self.channel = open_channel(address)
        self.stub = decode_pb2_grpc.DecodeStub(self.channel)
        self.count = 0

    def transfer(self) -> KVTransfer:
        self.count += 1
        return KVTransfer(f"bench-{self.count}", self.plan.num_tokens, self.blocks, 100)

    async def push(self, sender: GrpcKVSender) -> tuple[int, float]:
        """Generate (blocks reserved) -> timed send -> Generate read to its end (blocks freed).
        Returns the bytes the worker accepted and the seconds of the send alone."""
        t = self.transfer()
        prompt = [100 + (i * 7919 + self.count) % 20000 for i in range(t.num_tokens)]
        params = sampling_params_to_pb(SamplingParams(temperature=0, max_tokens=2), 2)
        call = self.stub.Generate(decode_pb2.GenerateRequest(
            request_id=t.request_id, prompt_token_ids=prompt, params=params), timeout=300)
        ack = await call.read()
        if ack is grpc.aio.EOF or ack.token_ids:
            raise RuntimeError("decode worker did not acknowledge the reservation")
        start = time.perf_counter()
        sent = await sender.send(self.address, t)
        seconds = time.perf_counter() - start
        while (msg := await call.read()) is not grpc.aio.EOF and not msg.finish_reason:
            pass
        return sent, seconds

    async def close(self) -> None:
        await self.channel.close()


async def bench_slab(driver: PushDriver, slab_mib: int, repeats: int) -> dict[str, Any]:
    """Push timings (send until the worker's reply) and serialization alone, one slab size."""
    sender = GrpcKVSender(driver.caches, slab_bytes=slab_mib * MIB)
    pushes = [await driver.push(sender) for _ in range(repeats + 1)]  # the first: a warm-up
    await sender.close()
    pushed, push_s = [n for n, _ in pushes], [s for _, s in pushes]
    assert all(n == driver.plan.kv_bytes for n in pushed), (pushed, driver.plan.kv_bytes)
    ser_s = await timed(lambda: serialize_only(sender, driver.transfer()), repeats)
    push = summarize(push_s[1:], driver.plan.kv_bytes)
    ser = summarize(ser_s, driver.plan.kv_bytes)
    wire_s = max(push["median_s"] - ser["median_s"], 1e-9)
    return {"slab_bytes": slab_mib * MIB, "push": push, "serialize": ser,
            "wire_s": wire_s, "wire_gib_per_s": driver.plan.kv_bytes / wire_s / GIB,
            "serialize_share": ser["median_s"] / push["median_s"]}


async def serialize_only(sender: GrpcKVSender, transfer: KVTransfer) -> int:
    """Every message of one push, serialized to the bytes grpc would send; no wire."""
    total = 0
    async for message in sender._chunks(transfer):
        total += len(message if isinstance(message, bytes) else message.SerializeToString())
    return total


# ---- processes ----------------------------------------------------------------------------------
def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_serving(address: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until the gRPC health check at `address` says SERVING; RuntimeError if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[3]} exited {proc.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
        if await check_health(address):
            return
        await asyncio.sleep(0.3)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f} s")


# ---- driver -------------------------------------------------------------------------------------
async def run_raw(args: argparse.Namespace, plan: Plan, logs: Path) -> dict[str, Any]:
    port = free_port()
    code = f"from pdserve.bench.transfer import serve_raw; serve_raw({port})"
    proc = spawn([sys.executable, "-c", code], logs / "raw-sink.log")
    try:
        return await bench_raw(port, plan.kv_bytes, args.raw_chunk_mib * MIB, args.repeats)
    finally:
        stop(proc)


async def run_pdserve(args: argparse.Namespace, plan: Plan, logs: Path) -> list[dict[str, Any]]:
    port = free_port()
    log = logs / "decode-worker.log"
    proc = spawn(decode_worker_argv(args, plan, port), log)
    caches, blocks = sender_cache(plan)
    try:
        await wait_serving(f"127.0.0.1:{port}", proc, log, args.startup_timeout)
        driver = PushDriver(f"127.0.0.1:{port}", plan, caches, blocks)
        try:
            return [await bench_slab(driver, mib, args.repeats) for mib in args.slab_mib]
        finally:
            await driver.close()
    finally:
        stop(proc)


async def measure(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    logs = Path(args.output_json).parent
    logs.mkdir(parents=True, exist_ok=True)
    raw = None if args.skip_raw else await run_raw(args, plan, logs)
    slabs = [] if args.skip_pdserve else await run_pdserve(args, plan, logs)
    for s in slabs:
        s["ratio_to_raw"] = s["push"]["gib_per_s"] / raw["gib_per_s"] if raw else None
    return {"raw": raw, "pdserve": slabs}


def environment() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__, "grpcio_version": grpc.__version__,
            "load_avg_1m_at_start": os.getloadavg()[0]}


def format_table(report: dict[str, Any]) -> str:
    """The report as a readable text table."""
    w, raw = report["workload"], report["raw"]
    load = report["environment"]["load_avg_1m_at_start"]
    lines = [f"KV of {w['num_blocks']} blocks x {w['num_layers']} layers = "
             f"{w['kv_bytes'] / MIB:.0f} MiB | load average {load:.1f}"]
    if raw:
        lines.append(f"raw grpcio, {raw['chunk_bytes'] // MIB} MiB messages: "
                     f"{raw['gib_per_s']:.2f} GiB/s (best {raw['best_gib_per_s']:.2f})")
    lines.append(f"{'slab MiB':>8}{'push GiB/s':>12}{'best':>7}{'vs raw':>8}"
                 f"{'push s':>8}{'serial. s':>10}{'wire s':>8}{'serial. %':>10}")
    for s in report["pdserve"]:
        ratio = "-" if s["ratio_to_raw"] is None else f"{s['ratio_to_raw']:.2f}"
        lines.append(
            f"{s['slab_bytes'] // MIB:>8}{s['push']['gib_per_s']:>12.2f}"
            f"{s['push']['best_gib_per_s']:>7.2f}{ratio:>8}{s['push']['median_s']:>8.3f}"
            f"{s['serialize']['median_s']:>10.3f}{s['wire_s']:>8.3f}"
            f"{100 * s['serialize_share']:>9.0f}%")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark for parsed `args`, print the table, write the JSON report; return it."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    plan, started = make_plan(args), time.perf_counter()
    env = environment()
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "environment": env,
        "workload": {"num_blocks": plan.num_blocks, "num_tokens": plan.num_tokens,
                     "num_layers": plan.layout.num_layers, "kv_bytes": plan.kv_bytes},
        **asyncio.run(measure(args, plan)),
    }
    report["elapsed_s"] = time.perf_counter() - started
    print(format_table(report))
    path = Path(args.output_json)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.transfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
