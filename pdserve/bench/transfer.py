"""KV transfer throughput: pdserve's PushKV over each data plane against raw grpcio and the
device's own copy bandwidth, measured in the same run.

    python -m pdserve.bench.transfer [--kv-mib 256] [--slab-mib 1,4,8] [--repeats 5]
        [--transport grpc,nixl,cuda_ipc] [--device cpu|cuda] [--kv-tokens 1024,4096,16384]

NOTE: what is measured, one run, the two ends of every stream in separate processes:

  raw        the ceiling: a grpc.aio client streams pre-made bytes messages (no protobuf) to a
             trivial grpc.aio sink in a child process that only counts them; `--raw-chunk-mib`
             messages for the ceiling, and each slab size's for a like-for-like ratio.
  push       pdserve's real path: a real decode worker (`pdserve decode --num-kv-blocks ...`)
             and, in this process, a KV cache shaped like the worker's model (default: the
             bundled SmolLM2, 30 layers x 3 kv heads x head dim 64, float32, block 16). Per push:
             open Generate (the worker reserves the blocks, then answers a message with no
             tokens, granting them to a data-plane push as it does for the gateway), time
             `PushKVSender.send` of the request's shuffled blocks up to the worker's reply (every
             slab written into its cache, the request committed), then read Generate to its end
             (the blocks are freed). Once per `--slab-mib` size and `--transport`: grpc
             carries the bytes in PushKV; nixl and cuda_ipc write them into the worker's
             reserved blocks (pdserve/transport/) and PushKV carries only ranges, so their slab
             size (`--plane-slab-mib`) only sets how many writes a push makes.
  copy       with `--device cuda`, the ceiling of a data plane: a device-to-device copy of the
             request's bytes in this process (`copy_`, contiguous), and the same bytes as a
             scatter of whole blocks (`index_copy_`), timed with CUDA synchronisation.
  concurrent with `--concurrency N` (N > 1): N pushes of the request at once, each its own
             request (reserved first, all of them), timed from the first send to the last
             reply; their bytes over that time, paired with the copy as above: what the data
             plane carries when the control plane's round trips overlap, as they do under load.
  parts      of each push: its data-plane writes (`write`; the rest of the push is `control_s`),
             from its commit sent to the decode worker's reply (`commit_to_reply_s`: the
             commit's trip, the decode engine committing the request, the reply's trip), and
             the handover: from the commit sent (every write done) to the request in the decode
             batch, read from Generate's tokens against a decode step (`handover()`)
  busy       with `--busy N`: N other requests decode in the worker all along (one-block
             prompts pushed over grpc, `BUSY_TOKENS` tokens each, then another), so a commit
             meets an engine in the middle of its steps, as under load
  serialize  the sender's own share: the same push's messages built to the bytes grpc sends, in
             this process, no wire. `wire` = push - serialize: what grpc on both sides and the
             receiver (parse, scatter into the cache) add.

Every case runs once per round, rounds `--repeats` times after a warm-up round, so all cases see
the same background load; the ratio to raw is the median of each round's own ratio. GiB/s
counts KV payload bytes. CPU timings on a shared box move with other processes: the report
records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import torch

from engine import handover_trace
from engine.kv_transfer import KVLayout
from engine.sampling_params import SamplingParams
from pdserve.bench.report import bench_main, config_of, write_report
from pdserve.bench.transfer_cases import (
    Case,
    concurrent_report,
    environment,
    format_table,
    push_report,
    run_rounds,
    summarize,
)
from pdserve.cluster.convert import sampling_params_to_pb
from pdserve.cluster.grpc_server import GRPC_OPTIONS, check_health, open_channel
from pdserve.ports import free_port
from prefill_svc.planes import PeerPlanes
from prefill_svc.push import KVPush
from prefill_svc.sender import PushKVSender
from protos import decode_pb2, decode_pb2_grpc

GIB, MIB = 1 << 30, 1 << 20
HANDOVER_TOKENS = 6  # per push: the prefill's first token, then the decode steps' (handover())
BUSY_TOKENS = 512  # each `--busy` request's tokens, then another takes its place
RAW_METHOD = "/pdserve.bench.Sink/Push"


def parse_sizes(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8]; ValueError unless every item is a positive integer."""
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes are positive integers separated by commas, got {text!r}")
    return sizes


def parse_transports(text: str) -> list[str]:
    """'grpc,nixl' -> ['grpc', 'nixl']; ValueError naming an unknown transport."""
    from pdserve.transport.base import TRANSPORTS

    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in TRANSPORTS]
    if not names or unknown:
        raise ValueError(f"transports are some of {', '.join(TRANSPORTS)}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to `parser` (shared by `pdserve bench transfer`)."""
    parser.add_argument("--model", default=None,
                        help="the decode worker's model; its KV layout must match the flags "
                             "below (default: bundled SmolLM2)")
    parser.add_argument("--kv-mib", type=int, default=256, help="KV bytes of the request")
    parser.add_argument("--kv-tokens", type=parse_sizes, default=None, metavar="A,B,..",
                        help="requests of these many tokens instead of --kv-mib (one each)")
    parser.add_argument("--transport", type=parse_transports, default=["grpc"],
                        metavar="grpc,nixl,cuda_ipc", help="data planes to measure")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both KV caches live")
    parser.add_argument("--decode-gpu", type=int, default=None, metavar="N",
                        help="with --device cuda: the decode worker on GPU N, the sending pool "
                             "on GPU 0 (the push crosses GPUs; the copy ceiling is then a "
                             "peer-to-peer copy_ from GPU 0 to GPU N)")
    parser.add_argument("--slab-mib", type=parse_sizes, default=[1, 4, 8], metavar="A,B,..",
                        help="PushKV slab sizes to measure")
    parser.add_argument("--plane-slab-mib", type=parse_sizes, default=[256], metavar="A,B,..",
                        help="slab sizes of the data planes (nixl, cuda_ipc): bytes per write")
    parser.add_argument("--block-order", default="shuffled", choices=["shuffled", "sequential"],
                        help="the sending pool's blocks of the request: shuffled (a fragmented "
                             "pool: one data-plane descriptor per block) or in order; the "
                             "decode worker reserves its own as its block manager hands them out")
    parser.add_argument("--concurrency", type=int, default=1, metavar="N",
                        help="also time N pushes at once (N > 1), each its own request")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="N other requests decoding in the worker while the pushes are "
                             "timed (a loaded decode worker: a commit waits for the step in "
                             "flight, and the engine thread is never idle)")
    parser.add_argument("--push-streams", default="shared", choices=["shared", "per-request"],
                        help="data-plane pushes on one shared PushKVStreams call, or a PushKV "
                             "stream each (the prefill worker's --kv-push-streams)")
    parser.add_argument("--raw-chunk-mib", type=int, default=4, help="raw stream message size")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads, this process")
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


def make_plans(args: argparse.Namespace) -> list[Plan]:
    """One request per `--kv-tokens` size, or one of `--kv-mib`."""
    layout = KVLayout(args.num_layers, args.num_kv_heads, args.head_dim, args.dtype,
                      args.block_size)
    if args.kv_tokens:
        return [Plan(layout, -(-n // args.block_size)) for n in args.kv_tokens]
    return [Plan(layout, max(1, args.kv_mib * MIB // Plan(layout, 1).block_bytes))]


# ---- (a) the raw grpcio ceiling -----------------------------------------------------------------
def serve_raw(port: int) -> None:
    """The raw sink (run in a child process): a grpc.aio server that counts the bytes of a
    client stream and answers their number as 8 little-endian bytes."""

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


def raw_case(channel: grpc.aio.Channel, source: bytes, chunk: int) -> Case:
    """Stream `source` as pre-made `chunk`-byte messages (no serializer) to the sink."""
    messages = [source[i:i + chunk] for i in range(0, len(source) - chunk + 1, chunk)]
    total = len(messages) * chunk
    push = channel.stream_unary(RAW_METHOD)

    async def stream() -> AsyncIterator[bytes]:
        for m in messages:
            yield m

    async def once() -> float:
        start = time.perf_counter()
        reply = await push(stream())
        seconds = time.perf_counter() - start
        if int.from_bytes(reply, "little") != total:
            raise RuntimeError(f"raw sink counted {int.from_bytes(reply, 'little')} of {total}")
        return seconds

    return Case(f"raw {chunk // MIB} MiB", total, once)


# ---- (b) pdserve's path: PushKVSender -> a real decode worker -----------------------------------
def decode_worker_argv(args: argparse.Namespace, plan: Plan, port: int) -> list[str]:
    """`pdserve decode` with room for `--concurrency` requests of the plan's blocks and the
    `--busy` ones (and a few spare), accepting every data plane it can."""
    model = ["--model", args.model] if args.model else []
    busy_blocks = args.busy * (-(-(args.block_size + BUSY_TOKENS) // args.block_size) + 1)
    return [
        sys.executable, "-m", "pdserve.cli", "decode", *model, "--port", str(port),
        "--num-kv-blocks", str(max(1, args.concurrency) * plan.num_blocks + busy_blocks + 8),
        "--max-model-len", str(max(plan.num_tokens, args.block_size + BUSY_TOKENS * bool(args.busy))
                               + 16),
        "--dtype", args.dtype, "--block-size", str(args.block_size), "--device", args.device,
        "--no-prefix-caching", "--max-num-seqs", str(max(4, args.concurrency) + args.busy),
        "--log-level", "info" if handover_trace.TRACE else "warning",  # the trace's lines
        "--kv-transport", "auto" if set(args.transport) != {"nixl"} else "nixl",
    ]


def sender_pool(plan: Plan, device: str, spare_blocks: int = 8, shuffled: bool = True
                ) -> tuple[torch.Tensor, list[int]]:
    """A random KV pool [L, 2, N, bs, Hkv, D] shaped like the decode worker's (one allocation,
    as the engine's), and the request's blocks: shuffled (a fragmented pool), or in order (a
    fresh one, as the block manager hands them out)."""
    lay, total = plan.layout, plan.num_blocks + spare_blocks
    gen = torch.Generator().manual_seed(0)
    shape = (lay.num_layers, 2, total, lay.block_size, lay.num_kv_heads, lay.head_dim)
    pool = torch.randn(shape, generator=gen).to(lay.torch_dtype).to(device)
    order = torch.randperm(total, generator=gen) if shuffled else torch.arange(total)
    return pool, order[: plan.num_blocks].tolist()


class PushTimes(NamedTuple):
    """One push as `PushDriver.push` timed it."""

    seconds: float  # the send alone
    commit_to_reply: float  # its commit sent -> the decode worker's reply
    handover: tuple[float, float] | None  # `handover()`; None when the tokens do not tell it
    commit: tuple[str, float]  # (request id, commit sent): for the decode worker's stamps


class PushDriver:
    """Drives one decode worker the way the gateway and a prefill worker do, one push at a time."""

    def __init__(self, channel: grpc.aio.Channel, address: str, plan: Plan, device: str,
                 shuffled: bool = True, shared_streams: bool = True) -> None:
        self.stub = decode_pb2_grpc.DecodeStub(channel)
        self.shared_streams = shared_streams  # the senders' (data-plane pushes)
        self.address, self.plan = address, plan
        self.pool, self.blocks = sender_pool(plan, device, shuffled=shuffled)
        self.caches = list(self.pool.unbind(0))
        self.senders: list[PushKVSender] = []
        self.decode_pid: int | None = None  # the decode worker's, for its CPU time
        self.count = 0
        self.use_grants = True  # data-plane pushes use the Generate's grant, as in serving

    def transfer(self, sender: PushKVSender, plan: Plan) -> KVPush:
        """A push of KV computed already: every slab final, the first token known."""
        self.count += 1
        push = sender.new_push(f"bench-{self.count}", plan.num_tokens)
        return push.computed(self.blocks[: plan.num_blocks], 100)

    async def _open(self, sender: PushKVSender, plan: Plan, max_tokens: int = HANDOVER_TOKENS
                    ) -> tuple[KVPush, Any]:
        """Generate: the decode worker reserves the request's blocks and acknowledges."""
        t = self.transfer(sender, plan)
        prompt = [100 + (i * 7919 + self.count) % 20000 for i in range(t.num_tokens)]
        params = sampling_params_to_pb(SamplingParams(temperature=0, ignore_eos=True),
                                       max_tokens)
        call = self.stub.Generate(decode_pb2.GenerateRequest(
            request_id=t.request_id, prompt_token_ids=prompt, params=params), timeout=300)
        ack = await call.read()
        if ack is grpc.aio.EOF or ack.token_ids:
            raise RuntimeError("the decode worker did not acknowledge the reservation")
        if self.use_grants and ack.HasField("kv_target"):
            t.grant = ack.kv_target  # as the gateway passes it on: no KVTarget rpc
        return t, call

    @staticmethod
    async def _token_times(call: Any) -> list[tuple[int, float]]:
        """Read Generate to its end (the blocks are freed): (tokens so far, arrival time) of
        every message carrying tokens."""
        times, count = [], 0
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.token_ids:
                count += len(msg.token_ids)
                times.append((count, time.perf_counter()))
            if msg.finish_reason:
                break
        return times

    @staticmethod
    def _check(sent: int, sender: PushKVSender, plan: Plan, transport: str) -> None:
        """What the push carried: every byte, over the transport asked for."""
        if sent != plan.kv_bytes:
            raise RuntimeError(f"the decode worker accepted {sent} of {plan.kv_bytes} bytes")
        if sender.stats.bytes_by_transport.get(transport, 0) != sender.stats.bytes:
            raise RuntimeError(f"a push meant for {transport} went over "
                               f"{sorted(sender.stats.bytes_by_transport)}")

    async def push(self, sender: PushKVSender, plan: Plan, transport: str) -> PushTimes:
        """Generate (blocks reserved) -> timed send -> Generate read to its end (blocks
        freed)."""
        t, call = await self._open(sender, plan)
        tokens = asyncio.ensure_future(self._token_times(call))
        start = time.perf_counter()
        sent = await sender.send(self.address, t)
        replied = time.perf_counter()
        self._check(sent, sender, plan, transport)
        committed = t.commit_sent_at or replied
        times = await tokens
        if handover_trace.TRACE:  # beside the decode worker's stamps, on the same clock
            print(f"handover [{t.request_id}] commit_sent={committed:.6f} tokens="
                  + " ".join(f"{n}@+{1e3 * (s - committed):.3f}" for n, s in times))
        return PushTimes(replied - start, replied - committed, handover(times, committed),
                         (t.request_id, committed))

    async def push_many(self, sender: PushKVSender, plan: Plan, transport: str, n: int,
                        case: Case | None = None) -> float:
        """`n` requests reserved, then their pushes at once: seconds from the first send to
        the last reply. With `case`, the CPU seconds per push meanwhile go into it: this
        process's (the sender's side and the driver's) and the decode worker's."""
        opened = [await self._open(sender, plan) for _ in range(n)]
        cpu = (time.process_time(), cpu_seconds(self.decode_pid))
        start = time.perf_counter()
        sent = await asyncio.gather(*(sender.send(self.address, t) for t, _ in opened))
        seconds = time.perf_counter() - start
        if case is not None and self.decode_pid is not None:
            case.cpu_sender.append((time.process_time() - cpu[0]) / n)
            case.cpu_decode.append((cpu_seconds(self.decode_pid) - cpu[1]) / n)
        for (_, call), nbytes in zip(opened, sent, strict=True):
            await self._token_times(call)
            self._check(nbytes, sender, plan, transport)
        return seconds

    async def keep_busy(self, n: int, stop: asyncio.Event, decoding: asyncio.Event) -> None:
        """Keep `n` one-block requests decoding (`BUSY_TOKENS` each, then another) until `stop`;
        `decoding` is set once all `n` have their first decode token."""
        sender = PushKVSender(self.caches)  # over grpc: their KV is one block
        self.senders.append(sender)
        small = Plan(self.plan.layout, 1)
        started: set[int] = set()

        async def one(i: int) -> None:
            while not stop.is_set():
                t, call = await self._open(sender, small, BUSY_TOKENS)
                await sender.send(self.address, t)
                try:
                    while (msg := await call.read()) is not grpc.aio.EOF:
                        if msg.token_ids and i not in started:
                            started.add(i)
                            if len(started) == n:
                                decoding.set()
                        if msg.finish_reason or stop.is_set():
                            break
                finally:
                    call.cancel()  # the worker aborts a request whose stream is gone

        await asyncio.gather(*(one(i) for i in range(n)))

    def concurrent_case(self, plan: Plan, transport: str, slab_mib: int, n: int) -> Case:
        """`n` pushes at once over `transport` (a sender of their own), as one case."""
        planes = None if transport == "grpc" else PeerPlanes(self.pool, transport)
        sender = PushKVSender(self.caches, slab_bytes=slab_mib * MIB, planes=planes,
                              plane_slab_bytes=slab_mib * MIB,
                              shared_streams=self.shared_streams)
        self.senders.append(sender)
        case = Case(f"push x{n} {transport} {slab_mib} MiB {plan.num_tokens} tok",
                    n * plan.kv_bytes, lambda: self.push_many(sender, plan, transport, n, case))
        return case

    def cases(self, plan: Plan, transport: str, slab_mib: int) -> list[Case]:
        """The push of one plan, transport and slab size (and for grpc the serialization)."""
        planes = None if transport == "grpc" else PeerPlanes(self.pool, transport)
        sender = PushKVSender(self.caches, slab_bytes=slab_mib * MIB, planes=planes,
                              plane_slab_bytes=slab_mib * MIB,
                              shared_streams=self.shared_streams)
        self.senders.append(sender)
        name = f"{transport} {slab_mib} MiB {plan.num_tokens} tok"

        async def push() -> float:
            before = sender.stats.write_seconds
            timed = await self.push(sender, plan, transport)
            if transport != "grpc":
                cases[0].write_seconds.append(sender.stats.write_seconds - before)
            cases[0].commit_to_reply.append(timed.commit_to_reply)
            cases[0].commits.append(timed.commit)
            if timed.handover is not None:
                cases[0].handover.append(timed.handover)
            return timed.seconds

        cases = [Case(f"push {name}", plan.kv_bytes, push)]
        if transport == "grpc":
            async def serialize() -> float:
                transfer, total = self.transfer(sender, plan), 0
                start = time.perf_counter()
                async for message in sender.messages(transfer):
                    total += len(message)
                return time.perf_counter() - start

            cases.append(Case(f"serialize {name}", plan.kv_bytes, serialize))
        return cases

    async def close(self) -> None:
        for sender in self.senders:
            await sender.close()


# ---- (c) the device's own copy bandwidth (CUDA) -------------------------------------------------
def handover(tokens: list[tuple[int, float]], committed: float) -> tuple[float, float] | None:
    """(handover, step) seconds from the arrival times of Generate's tokens, all of them from
    the decode worker's steps (Generate does not repeat the prefill's first token). From the
    commit sent (every write synchronised) to the first of them is the handover (the commit's
    trip, the engine taking the request into its batch), one decode step and the token's trip;
    the median gap between the later tokens is a decode step (each token's trip the same), so
    the handover is the first less the step. With the engine's overlap a token leaves while
    the next step runs: on a GPU that step is in flight, on a CPU (a launch is the compute) it
    has run, so there the first token arrives a step late and the handover reads a step high."""
    at: dict[int, float] = {}
    for count, t in tokens:
        for i in range(len(at) + 1, count + 1):
            at[i] = t
    if len(at) < 3:
        return None
    step = statistics.median(at[i + 1] - at[i] for i in range(2, len(at)))
    return at[1] - committed - step, step


def to_batch(log: Path, cases: list[Case], repeats: int) -> None:
    """Fill each push case's `to_batch` from the decode worker's handover stamps (its log, on
    the same clock as the commits): the commit sent -> the request's first step scheduled, for
    the timed rounds' pushes."""
    stamps = handover_trace.merge(log.read_text().splitlines())
    for case in cases:
        for request_id, committed in case.commits[-repeats:]:
            at = handover_trace.in_batch_at(stamps.get(request_id, []))
            if at is not None:
                case.to_batch.append(at - committed)


def copy_cases(plan: Plan, pool: torch.Tensor, blocks: list[int],
               peer: torch.device | None = None) -> list[Case]:
    """A contiguous device copy of the request's bytes, and the same as a block scatter; with
    `peer` (another GPU), the copy goes from the pool's GPU to it (peer to peer) and the scatter
    runs on it."""
    src = pool[:, :, blocks[: plan.num_blocks]].contiguous()
    there = peer or pool.device
    dst = torch.empty_like(src, device=there)
    ids = torch.tensor(blocks[: plan.num_blocks], device=there)
    target, src_there = torch.empty_like(pool, device=there), src.to(there)
    devices = {pool.device, there}

    def timed(fn: Callable[[], object]) -> Callable[[], Awaitable[float]]:
        async def once() -> float:
            for d in devices:
                torch.cuda.synchronize(d)
            start = time.perf_counter()
            fn()
            for d in devices:
                torch.cuda.synchronize(d)
            return time.perf_counter() - start
        return once

    kind = "peer copy" if peer is not None else "copy"
    return [Case(f"{kind} {plan.num_tokens} tok", plan.kv_bytes, timed(lambda: dst.copy_(src))),
            Case(f"scatter {plan.num_tokens} tok", plan.kv_bytes,
                 timed(lambda: target.index_copy_(2, ids, src_there)))]


# ---- processes ----------------------------------------------------------------------------------
def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc); 0 without one."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def child(argv: list[str], log: Path, env: dict[str, str] | None = None
          ) -> Iterator[subprocess.Popen]:
    """A child process logging to `log` (with `env` over this one's), terminated (then
    killed) on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_serving(channel: grpc.aio.Channel, address: str, proc: subprocess.Popen,
                       log: Path, timeout_s: float, health: bool = True) -> None:
    """Until the server at `address` is up (its gRPC health check says SERVING when `health`);
    RuntimeError if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(channel.channel_ready(), 0.5)
            if not health or await check_health(address):
                return
        await asyncio.sleep(0.3)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f} s")


# ---- driver -------------------------------------------------------------------------------------
async def measure(args: argparse.Namespace, plans: list[Plan]) -> dict[str, Any]:
    """Start the raw sink and the decode worker, time every case in rounds; the sections."""
    logs = Path(args.output_json).parent
    logs.mkdir(parents=True, exist_ok=True)
    raw_addr, dec_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sink = [sys.executable, "-c", "from pdserve.bench.transfer import serve_raw; "
            f"serve_raw({raw_addr.rsplit(':', 1)[1]})"]
    largest = max(plans, key=lambda plan: plan.num_blocks)
    peer, dec_env = None, None
    if args.decode_gpu is not None:  # its GPU first, then GPU 0, as `pdserve up` lists them
        peer = torch.device("cuda", args.decode_gpu)
        dec_env = {"CUDA_VISIBLE_DEVICES": f"{args.decode_gpu},0"}
    with (child(sink, logs / "raw-sink.log") as sink_proc,
          child(decode_worker_argv(args, largest, int(dec_addr.rsplit(":", 1)[1])),
                logs / "decode-worker.log", dec_env) as dec_proc):
        async with open_channel(raw_addr) as raw_ch, open_channel(dec_addr) as dec_ch:
            await wait_serving(raw_ch, raw_addr, sink_proc, logs / "raw-sink.log", 60, False)
            await wait_serving(dec_ch, dec_addr, dec_proc, logs / "decode-worker.log",
                               args.startup_timeout)
            driver = PushDriver(dec_ch, dec_addr, largest, args.device,
                                shuffled=args.block_order == "shuffled",
                                shared_streams=args.push_streams == "shared")
            driver.decode_pid = dec_proc.pid
            raw_sizes = sorted({args.raw_chunk_mib, *args.slab_mib})
            # at least one message of each size, however small the request's KV
            source = os.urandom(max(min(largest.kv_bytes, 256 * MIB), raw_sizes[-1] * MIB))
            raws = {mib: raw_case(raw_ch, source, mib * MIB) for mib in raw_sizes}
            pushes = {(plan.num_tokens, t, mib): driver.cases(plan, t, mib)
                      for plan in plans for t in args.transport
                      for mib in (args.slab_mib if t == "grpc" else args.plane_slab_mib)}
            copies = ({plan.num_tokens: copy_cases(plan, driver.pool, driver.blocks, peer)
                       for plan in plans} if args.device == "cuda" else {})
            many = ({key: driver.concurrent_case(plan, key[1], key[2], args.concurrency)
                     for plan in plans for key in pushes if key[0] == plan.num_tokens}
                    if args.concurrency > 1 else {})
            stop, decoding = asyncio.Event(), asyncio.Event()
            busy = (asyncio.ensure_future(driver.keep_busy(args.busy, stop, decoding))
                    if args.busy else None)
            try:
                if busy is not None:
                    await asyncio.wait([busy, asyncio.ensure_future(decoding.wait())],
                                       return_when=asyncio.FIRST_COMPLETED)
                    if busy.done():
                        busy.result()  # raises what went wrong
                await run_rounds([*raws.values(), *(c for cs in pushes.values() for c in cs),
                                  *many.values(), *(c for cs in copies.values() for c in cs)],
                                 args.repeats)
            finally:
                stop.set()
                if busy is not None:
                    await busy
                await driver.close()
    if handover_trace.TRACE:
        to_batch(logs / "decode-worker.log", [cs[0] for cs in pushes.values()], args.repeats)
    ceiling = raws[args.raw_chunk_mib]
    return {"raw": {"chunk_bytes": args.raw_chunk_mib * MIB, **summarize(ceiling)},
            "raw_by_size": [{"chunk_bytes": mib * MIB, **summarize(c)} for mib, c in raws.items()],
            "copy": [{"num_tokens": n, "copy": summarize(c), "scatter": summarize(sc)}
                     for n, (c, sc) in copies.items()],
            "pdserve": [push_report(key, cases, ceiling, raws.get(key[2], ceiling),
                                    copies.get(key[0]))
                        for key, cases in pushes.items()],
            "concurrent": [concurrent_report(key, case, args.concurrency, copies.get(key[0]))
                           for key, case in many.items()]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark for parsed `args`, print the table, write the JSON report; return it."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.busy < 0:
        raise ValueError(f"--busy must be >= 0, got {args.busy}")
    if args.decode_gpu is not None and (args.device != "cuda" or args.decode_gpu < 1):
        raise ValueError("--decode-gpu needs --device cuda and a GPU other than 0 (the "
                         f"sending pool's), got {args.decode_gpu} with --device {args.device}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    plans, started = make_plans(args), time.perf_counter()
    report: dict[str, Any] = {
        "config": config_of(args),
        "environment": environment(),
        "workload": [{"num_blocks": plan.num_blocks, "num_tokens": plan.num_tokens,
                      "num_layers": plan.layout.num_layers, "kv_bytes": plan.kv_bytes}
                     for plan in plans],
        **asyncio.run(measure(args, plans)),
    }
    report["elapsed_s"] = time.perf_counter() - started
    print(format_table(report))
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("transfer", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
