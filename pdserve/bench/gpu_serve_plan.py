"""The plan of `python -m pdserve.bench.gpu_serve`: its flags (defaults: docs/loadtest.md's GPU
run), the frozen config built from them once, and the command lines it starts, per system. Pure:
no process starts here (tests/test_gpu_serve_plan.py)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loadtest.cli import parse_len, parse_rates
from pdserve.bench.gpu_model import ModelShape

# One GPU: the colocated server, or 1 prefill + 1 decode worker sharing it (KV over grpc or
# cuda_ipc). Two GPUs: two colocated replicas (GPU 0 and GPU 1, the load alternating between
# them), or prefill on GPU 0 and decode on GPU 1 (split_grpc, split_cuda_ipc).
SYSTEMS = ("colocated", "grpc", "cuda_ipc", "replicas", "split_grpc", "split_cuda_ipc")
DEFAULT_SYSTEMS = ("colocated", "grpc", "cuda_ipc")
# Load mixes (--mix): prompt and output lengths, and the context they need
MIXES = {
    "prefill_heavy": ((1024, 4096), (64, 256), 4608),
    "decode_heavy": ((128, 512), (256, 512), 1280),
}
SHAPES = {
    "full": ModelShape(),  # the 1B shape of the kernels issue
    # vocab 49152: the SmolLM2 tokenizer's, whose ids the load generator sends
    "tiny": ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                       vocab=49152),
}
SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


@dataclass(frozen=True)
class LoadConfig:
    """The load generator's flags (docs/loadtest.md's GPU run)."""

    request_rates: tuple[float, ...] = (16.0, math.inf)
    num_prompts: int = 96
    input_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (128, 128)
    num_warmups: int = 2
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 50.0
    max_duration_s: float = 60.0
    seed: int = 0
    tokenizer: str | None = None  # None: pdserve's bundled SmolLM2 tokenizer
    # the load generator's (loadtest/processes.py): one process was the bound at saturation on
    # the GPU machines (docs/loadtest.md, 2026-12-04); figures before that day had one
    client_processes: int = 4

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.num_warmups < 0 or self.max_duration_s <= 0:
            raise ValueError("--num-prompts >= 1, --num-warmups >= 0, --max-duration > 0")


@dataclass(frozen=True)
class ServeConfig:
    systems: tuple[str, ...]
    shape: ModelShape
    model_dir: Path
    kv_cache_memory: int
    max_model_len: int
    redis_server: str
    out_dir: Path
    startup_timeout_s: float
    load: LoadConfig
    work_dir: Path | None = None  # the load generator's reports and the logs (None: out_dir)
    api_server_count: int = 1  # gateway processes of a split system (`pdserve up`'s flag)
    stream_interval: int = 1  # every system's engines stream a request's tokens this many a time
    generate_streams: str = "shared"  # a split system's gateways (`pdserve up`'s flag)
    engine_core: str = "process"  # a colocated server's engine loop: thread or process
    colocated_api_servers: int = 1  # HTTP servers in front of a colocated system's engine core
    decode_engine_core: str = "auto"  # a split system's decode worker's engine loop
    # the rates whose runs open the servers' stack samplers' gate (None: the whole load); when
    # a subset, the load generator runs once per rate (each after its own warm-ups)
    sample_rates: tuple[float, ...] | None = None
    prefill_engine_core: str = "auto"  # a split system's prefill worker's engine loop
    shared_gpu_pace_ms: float = 4.0  # a one-GPU split system's decode worker's step pacing
    shared_gpu_pace_tokens: int = 0  # ... while this many prompt tokens are on their way
    prefill_streams: str = "shared"  # a split system's gateways (`pdserve up`'s flag)

    def __post_init__(self) -> None:
        if not self.systems or set(self.systems) - set(SYSTEMS):
            raise ValueError(f"--systems is a comma list of {','.join(SYSTEMS)}")
        if self.api_server_count < 1 or self.colocated_api_servers < 1:
            raise ValueError("--api-server-count and --colocated-api-servers must be >= 1")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if not self.shared_gpu_pace_ms >= 0:
            raise ValueError("--shared-gpu-pace-ms must be >= 0")
        if self.shared_gpu_pace_tokens < 0:
            raise ValueError("--shared-gpu-pace-tokens must be >= 0")
        if self.kv_cache_memory < 1 or self.max_model_len < 1:
            raise ValueError("--kv-cache-memory and --max-model-len must be >= 1")
        if self.sample_rates is not None and set(self.sample_rates) - set(self.load.request_rates):
            raise ValueError("--sample-rates must be some of --request-rate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options; the defaults are docs/loadtest.md's GPU run."""
    load = LoadConfig()
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"in this order, of {','.join(SYSTEMS)}")
    p.add_argument("--work-dir", default=None, help="the load generator's reports and the "
                   "servers' logs (default: --out-dir; the summary always goes there)")
    p.add_argument("--mix", default=None, choices=sorted(MIXES),
                   help="prompt/output lengths and max model len of a load mix (overrides "
                        "--input-len, --output-len, --max-model-len)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "bench_results/gpu_serve",
                   help="reports, logs and the summary (default: $OUT, else bench_results/)")
    p.add_argument("--redis-server", default="redis-server", help="the binary (default: PATH)")
    p.add_argument("--tokenizer", default=None, help="the load generator's (an HF folder with "
                   "config.json; default: pdserve's bundled SmolLM2)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to /ready")
    m = p.add_argument_group("model and server")
    m.add_argument("--shape", default="full", choices=sorted(SHAPES), help="tiny: CPU dry runs")
    for name in SHAPE_FLAGS:
        m.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help="overrides the shape's")
    m.add_argument("--model-dir", default=None,
                   help="the random model (default: a folder named by its shape in /tmp)")
    m.add_argument("--kv-cache-memory", type=int, default=8 << 30, help="bytes per engine")
    m.add_argument("--max-model-len", type=int, default=2048)
    m.add_argument("--api-server-count", type=int, default=1,
                   help="gateway processes of the split systems (pdserve up's flag)")
    m.add_argument("--generate-streams", default="shared", choices=["shared", "per-request"],
                   help="the split systems' token streams from the decode worker: one shared "
                        "call per gateway or a call per request (pdserve up's flag)")
    m.add_argument("--prefill-streams", default="shared", choices=["shared", "per-request"],
                   help="the split systems' Prefill calls: messages on one shared call per "
                        "gateway and prefill worker, or a call per request (pdserve up's flag)")
    m.add_argument("--stream-interval", type=int, default=1,
                   help="every system's engines send a request's tokens this many at a time "
                        "after its first (pdserve up's flag)")
    m.add_argument("--engine-core", default="process", choices=["thread", "process"],
                   help="the colocated systems' engine loop: a thread of the server's process "
                        "or a process of its own (pdserve up's flag)")
    m.add_argument("--decode-engine-core", default="auto",
                   choices=["auto", "thread", "process"],
                   help="the split systems' decode worker's engine loop: a thread of its "
                        "process or a process of its own (pdserve up --engine-core without "
                        "--colocated); auto: the worker's default (a process on a GPU without "
                        "tensor parallelism)")
    m.add_argument("--prefill-engine-core", default="auto",
                   choices=["auto", "thread", "process"],
                   help="the split systems' prefill worker's engine loop: a thread of its "
                        "process or a process of its own (pdserve up --prefill-engine-core); "
                        "auto: the worker's default (a process on a GPU without tensor "
                        "parallelism)")
    m.add_argument("--shared-gpu-pace-ms", type=float, default=4.0,
                   help="the one-GPU split systems' decode worker paces its steps this far "
                        "apart while the prefill worker beside it marks a step, or while "
                        "--shared-gpu-pace-tokens prompt tokens are on their way (pdserve up's "
                        "flag; 0: off)")
    m.add_argument("--shared-gpu-pace-tokens", type=int, default=0,
                   help="the prompt tokens on their way from which --shared-gpu-pace-ms holds "
                        "(pdserve up's flag; 0: never by tokens)")
    m.add_argument("--colocated-api-servers", type=int, default=1,
                   help="the colocated systems' HTTP servers sharing one engine core (pdserve up "
                        "--colocated --api-server-count)")
    g = p.add_argument_group("load (python -m loadtest)")
    g.add_argument("--request-rate", type=parse_rates, default=load.request_rates)
    g.add_argument("--num-prompts", type=int, default=load.num_prompts, help="per rate")
    g.add_argument("--input-len", type=parse_len, default=load.input_len, metavar="N|LO-HI")
    g.add_argument("--output-len", type=parse_len, default=load.output_len, metavar="N|LO-HI")
    g.add_argument("--num-warmups", type=int, default=load.num_warmups)
    g.add_argument("--slo-ttft-ms", type=float, default=load.slo_ttft_ms)
    g.add_argument("--slo-tpot-ms", type=float, default=load.slo_tpot_ms)
    g.add_argument("--max-duration", type=float, default=load.max_duration_s, help="s per rate")
    g.add_argument("--seed", type=int, default=load.seed, help="prompts, arrivals and weights")
    g.add_argument("--client-processes", type=int, default=load.client_processes,
                   help="the load generator sends from this many processes")
    g.add_argument("--sample-rates", type=parse_rates, default=None,
                   help="only these rates' runs open the stack samplers' gate "
                        "(PDSERVE_STACK_SAMPLE_WHILE; default: the whole load)")


def config_of(args: argparse.Namespace) -> ServeConfig:
    """The run's config from parsed `args`. Raises ValueError."""
    if args.mix is not None:
        args.input_len, args.output_len, args.max_model_len = MIXES[args.mix]
    given = {n: getattr(args, n) for n in SHAPE_FLAGS if getattr(args, n) is not None}
    shape = dataclasses.replace(SHAPES[args.shape], max_positions=args.max_model_len, **given)
    load = LoadConfig(args.request_rate, args.num_prompts, args.input_len, args.output_len,
                      args.num_warmups, args.slo_ttft_ms, args.slo_tpot_ms, args.max_duration,
                      args.seed, args.tokenizer, args.client_processes)
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / f"pdserve-{shape_tag(shape)}")
    return ServeConfig(tuple(s.strip() for s in args.systems.split(",") if s.strip()), shape,
                       model_dir, args.kv_cache_memory, args.max_model_len, args.redis_server,
                       Path(args.out_dir), args.startup_timeout, load,
                       Path(args.work_dir) if args.work_dir else None, args.api_server_count,
                       args.stream_interval, args.generate_streams, args.engine_core,
                       args.colocated_api_servers, args.decode_engine_core, args.sample_rates,
                       args.prefill_engine_core, args.shared_gpu_pace_ms,
                       args.shared_gpu_pace_tokens, args.prefill_streams)


def shape_tag(shape: ModelShape) -> str:
    return (f"L{shape.layers}-H{shape.hidden}-A{shape.heads}x{shape.kv_heads}x{shape.head_dim}"
            f"-I{shape.intermediate}-V{shape.vocab}-P{shape.max_positions}")


# ---- the command lines ---------------------------------------------------------------------------
def up_argv(cfg: ServeConfig, system: str, port: int, redis_url: str) -> list[str]:
    """`pdserve up` for `system`: colocated (also each of the replicas, whose GPU is its
    CUDA_VISIBLE_DEVICES), or 1 prefill + 1 decode with that KV transport, on one GPU or
    (split_*) prefill on GPU 0 and decode on GPU 1."""
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(cfg.model_dir),
            "--kv-cache-memory", str(cfg.kv_cache_memory), "--max-model-len",
            str(cfg.max_model_len), "--port", str(port), "--stream-interval",
            str(cfg.stream_interval)]
    if system in ("colocated", "replicas"):
        return [*argv, "--colocated", "--engine-core", cfg.engine_core, "--api-server-count",
                str(cfg.colocated_api_servers)]
    transport = system.removeprefix("split_")
    gpus = ["--prefill-gpus", "0", "--decode-gpus", "1"] if system.startswith("split_") else []
    return [*argv, "--redis-url", redis_url, "--kv-transport", transport, *gpus,
            "--api-server-count", str(cfg.api_server_count), "--generate-streams",
            cfg.generate_streams, "--prefill-streams", cfg.prefill_streams,
            *([] if cfg.prefill_engine_core == "auto" else
              ["--prefill-engine-core", cfg.prefill_engine_core]),
            *([] if cfg.decode_engine_core == "auto" else
              ["--engine-core", cfg.decode_engine_core]),
            *(["--shared-gpu-pace-ms", str(cfg.shared_gpu_pace_ms),
               "--shared-gpu-pace-tokens", str(cfg.shared_gpu_pace_tokens)]
              if not gpus else [])]


REPLICAS = 2  # "replicas": one colocated server per GPU


def redis_argv(binary: str, port: int, workdir: Path) -> list[str]:
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(workdir), "--loglevel", "warning"]


def loadtest_argv(load: LoadConfig, system: str, base_url: str, metrics_urls: list[str],
                  output_json: Path) -> list[str]:
    """`python -m loadtest` with the docs' flags, no plots and no progress bars."""
    argv = [sys.executable, "-m", "loadtest", "--base-url", base_url,
            "--request-rate", ",".join(f"{r:g}" for r in load.request_rates),
            "--num-prompts", str(load.num_prompts), "--input-len", _len(load.input_len),
            "--output-len", _len(load.output_len), "--num-warmups", str(load.num_warmups),
            "--max-duration", f"{load.max_duration_s:g}", "--slo-ttft-ms", f"{load.slo_ttft_ms:g}",
            "--slo-tpot-ms", f"{load.slo_tpot_ms:g}", "--seed", str(load.seed), "--label", system,
            "--output-json", str(output_json), "--no-plots", "--no-progress"]
    if load.tokenizer:
        argv += ["--tokenizer", load.tokenizer]
    if load.client_processes != 1:
        argv += ["--client-processes", str(load.client_processes)]
    for url in metrics_urls:
        argv += ["--metrics-url", url]
    return argv


def _len(span: tuple[int, int]) -> str:
    return str(span[0]) if span[0] == span[1] else f"{span[0]}-{span[1]}"
