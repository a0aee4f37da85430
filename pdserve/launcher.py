"""`pdserve up`: the whole cluster on this machine, one process per service.

    redis-server (loopback, free port) ─┐
    pdserve tokenizer                   ├─ wait until every one is healthy, print the URL,
    pdserve prefill  x N                │  then watch; Ctrl-C or SIGTERM stops them all,
    pdserve decode   x M                │  gateway first, Redis last
    pdserve gateway (OpenAI API)       ─┘

Each worker runs --<role>-tp tensor-parallel ranks on as many GPUs of --<role>-gpus. With
`--colocated`, only the gateway runs, with the engine in-process (`pdserve serve`), sized like a
decode worker (--decode-tp, --decode-gpus).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from engine.config import (
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
)
from kernels.cache_root import cache_root
from pdserve.cluster.flags import (
    add_chat_template_flag,
    add_flag,
    add_generate_streams_flag,
    add_kv_doorbell_flag,
    add_kv_push_streams_flag,
    add_kv_transport_flag,
    add_prefill_streams_flag,
    add_redis_namespace_flag,
    add_shared_gpu_pace_flags,
    add_stream_interval_flag,
    add_tls_flags,
)
from pdserve.cluster.lora import add_lora_flags, lora_argv
from pdserve.cluster.tls import PLAINTEXT, TLSConfig, tls_from_args
from pdserve.ports import free_port, reserve


def cluster_file() -> Path:
    """Where `pdserve up` records its cluster (gateway URL, Redis URL, pids) for `status`."""
    if os.environ.get("PDSERVE_CLUSTER_FILE"):
        return Path(os.environ["PDSERVE_CLUSTER_FILE"])
    return Path(cache_root()) / "cluster.json"


@dataclass
class Service:
    name: str
    argv: list[str]
    health: str  # "grpc:host:port", "http:url" or "redis:port"
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--model", None, help="local HF folder or .gguf (default: bundled SmolLM2)")
    add_flag(p, "--host", "127.0.0.1", help="gateway interface")
    add_flag(p, "--port", 8000, type=int, help="gateway port")
    add_flag(p, "--prefill", 1, type=int, help="prefill workers")
    add_flag(p, "--decode", 1, type=int, help="decode workers")
    add_flag(p, "--prefill-tp", 1, type=int,
             help="tensor-parallel ranks of each prefill worker (one GPU each)")
    add_flag(p, "--decode-tp", 1, type=int, help="tensor-parallel ranks of each decode worker; "
             "with --colocated, of the one engine")
    add_flag(p, "--enable-expert-parallel", False, action="store_true",
             help="mixture-of-experts models: whole experts per tensor-parallel rank")
    add_flag(p, "--prefill-gpus", "", help="GPUs of the prefill workers, e.g. 0 or 0,1: worker i "
             "gets the --prefill-tp of them from position i*tp on, wrapping around the list, as "
             "its visible devices (default: what the shell sees)")
    add_flag(p, "--decode-gpus", "", help="GPUs of the decode workers (with --colocated, of the "
             "one engine), dealt as --prefill-gpus by --decode-tp")
    add_flag(p, "--colocated", False, action="store_true",
             help="one in-process engine behind the gateway, no workers; sized by --decode-tp "
                  "and --decode-gpus")
    add_flag(p, "--redis-url", "", help="use this Redis instead of starting one")
    add_redis_namespace_flag(p)
    add_tls_flags(p)
    add_flag(p, "--kv-cache-memory", 512 << 20, type=int, help="KV cache bytes per worker")
    add_flag(p, "--max-model-len", None, type=int, help="context length served")
    add_flag(p, "--dtype", "auto", help="auto, float32, bfloat16, float16")
    add_flag(p, "--quantization", None, choices=QUANTIZATION_CHOICES, help=QUANTIZATION_HELP)
    add_flag(p, "--kv-cache-dtype", "auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_DTYPE_HELP)
    add_flag(p, "--enforce-eager", False, action="store_true",
             help="every worker runs its steps eagerly (no CUDA graphs)")
    add_flag(p, "--speculative-config", "",
             help='speculative decoding as JSON, handed to the decode workers (with --colocated, '
                  'the engine): {"method": "ngram", "num_speculative_tokens": 3}')
    add_flag(p, "--local-prefill-max-tokens", 0, type=int,
             help="prompts up to this many tokens prefill on the decode worker (0: never)")
    add_flag(p, "--api-server-count", 1, type=int,
             help="gateway processes sharing --port (SO_REUSEPORT: the kernel spreads client "
                  "connections over them); one Python process streams a few thousand tokens/s "
                  "(with --colocated: servers sharing one engine core process)")
    add_flag(p, "--routing", "kv_aware", choices=["kv_aware", "load", "round_robin"],
             help="how the gateway picks workers: kv_aware (prefill workers holding the "
                  "prompt's prefix, against load), load, round_robin")
    add_kv_transport_flag(p)  # handed to every prefill and decode worker
    add_kv_push_streams_flag(p)  # handed to every prefill worker
    add_kv_doorbell_flag(p)  # handed to every decode worker
    add_shared_gpu_pace_flags(p)  # handed to every decode worker
    add_stream_interval_flag(p)  # handed to every decode worker (with --colocated, the engine)
    p.add_argument("--engine-core", default=None, choices=["thread", "process"],
                   help="where the engine loop runs: with --colocated the server's (pdserve "
                        "serve's --engine-core; default process), else every decode worker's "
                        "(pdserve decode's --engine-core; default auto: a process on a GPU, a "
                        "thread on the CPU); prefill workers: --prefill-engine-core")
    p.add_argument("--prefill-engine-core", default=None,
                   choices=["auto", "thread", "process"],
                   help="where every prefill worker's engine loop runs (pdserve prefill's "
                        "--engine-core; default auto: a process on a GPU, a thread on the CPU)")
    add_generate_streams_flag(p)  # handed to every gateway
    add_prefill_streams_flag(p)  # handed to every gateway
    add_chat_template_flag(p)  # handed to the tokenizer (with --colocated, to the engine's)
    add_flag(p, "--tool-call-parser", "hermes",
             help='how the model writes tool calls, for tool_choice "auto": hermes, smollm2, '
                  "llama3_json (the gateway gets --enable-auto-tool-choice with it)")
    add_flag(p, "--no-auto-tool-choice", False, action="store_true",
             help='serve no tool_choice "auto" (tools then need "required" or a named one)')
    add_flag(p, "--api-key", "", help="the gateway requires this bearer key on /v1 routes, "
             "/tokenize, /detokenize and /workers (handed over in its environment, not argv)")
    add_lora_flags(p)  # every worker (the colocated engine) and the gateway get them
    add_flag(p, "--startup-timeout", 300.0, type=float, help="seconds to wait for health")
    add_flag(p, "--log-level", "info", help="debug, info, warning, error")


def plan(args: argparse.Namespace, redis_url: str, redis_port: int | None) -> list[Service]:
    """The processes to start, in start order, with their flags and health probes."""
    py = [sys.executable, "-m", "pdserve.cli"]
    model = ["--model", args.model] if args.model else []
    common = [*model, "--log-level", args.log_level]
    if args.max_model_len:
        common += ["--max-model-len", str(args.max_model_len)]
    engine = ["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory)]
    if args.quantization:
        engine += ["--quantization", args.quantization]
    if args.kv_cache_dtype != "auto":  # every worker alike: KV moves between them
        engine += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.enable_expert_parallel:
        engine += ["--enable-expert-parallel"]
    if args.enforce_eager:
        engine += ["--enforce-eager"]
    workers = ["--kv-transport", args.kv_transport]  # prefill and decode only
    cluster = _cluster_flags(args)  # what every disaggregated service must agree on
    internal = ["--host", "127.0.0.1"]  # only the gateway listens on --host; workers: loopback
    gateway_url = f"http://{args.host}:{args.port}"
    template = ["--chat-template", args.chat_template] if args.chat_template else []
    spec = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    decoding = [*spec, "--stream-interval", str(args.stream_interval)]  # engines that decode
    engine += lora_argv(args)  # LoRA: the engines' flags and --lora-modules (they preload them)
    if args.api_server_count < 1:
        raise SystemExit("pdserve up: --api-server-count must be at least 1")
    if args.colocated:
        argv = [*py, "serve", *common, *engine, *decoding, *template, *_tool_flags(args)]
        if args.engine_core is not None:
            argv += ["--engine-core", args.engine_core]
        return _colocated(args, argv, gateway_url)
    services = []
    if redis_port is not None:
        services.append(Service("redis", redis_argv(redis_port), f"redis:{redis_port}"))
    tok_port = free_port()
    services.append(Service("tokenizer", [*py, "tokenizer", *common, *template, *cluster, *internal,
                                          "--port", str(tok_port), "--redis-url", redis_url],
                            f"grpc:127.0.0.1:{tok_port}"))
    envs = {role: _gpu_envs(args, role, count)
            for role, count in (("prefill", args.prefill), ("decode", args.decode))}
    marks = _step_marks_folders(args.port, envs)
    for role, role_envs in envs.items():
        tp = ["--tensor-parallel-size", str(getattr(args, f"{role}_tp"))]
        for i, env in enumerate(role_envs):
            port = free_port()
            argv = [*py, role, *common, *engine, *workers, *tp, *cluster, *internal, "--port",
                    str(port), "--redis-url", redis_url, "--metrics-port", str(free_port())]
            if (folder := marks.get(_own_gpu(env))) is not None:
                argv += ["--shared-gpu-step-marks", folder]
            if role == "decode":
                argv += [*decoding, "--kv-doorbell", args.kv_doorbell,
                         "--shared-gpu-pace-ms", str(args.shared_gpu_pace_ms),
                         "--shared-gpu-pace-tokens", str(args.shared_gpu_pace_tokens)]
                if args.engine_core is not None:
                    argv += ["--engine-core", args.engine_core]
            else:
                argv += ["--kv-push-streams", args.kv_push_streams]
                if args.prefill_engine_core is not None:
                    argv += ["--engine-core", args.prefill_engine_core]
            services.append(Service(f"{role}-{i}", argv, f"grpc:127.0.0.1:{port}", env=env))
    argv = [*py, "gateway", *cluster, "--host", args.host, "--port", str(args.port),
            "--redis-url", redis_url, "--tokenizer-address", f"127.0.0.1:{tok_port}", "--log-level",
            args.log_level, "--local-prefill-max-tokens", str(args.local_prefill_max_tokens),
            "--routing", args.routing, "--generate-streams", args.generate_streams,
            "--prefill-streams", args.prefill_streams,
            *_tool_flags(args), *lora_argv(args, engine=False)]
    if args.api_server_count > 1:
        argv += ["--reuse-port"]
    for i in range(args.api_server_count):
        services.append(Service("gateway" if i == 0 else f"gateway-{i}", argv,
                                f"http:{gateway_url}/ready", env=_key_env(args)))
    return services


def _key_env(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's --api-key, as its PDSERVE_API_KEY: argv is readable by every local user
    (ps), the environment only by the owner. Set even when empty, so that a key left in the
    shell does not apply when --api-key "" said none."""
    return {"PDSERVE_API_KEY": args.api_key}


def _tool_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's tool-call flags: auto tool choice with --tool-call-parser, unless
    --no-auto-tool-choice."""
    if args.no_auto_tool_choice or not args.tool_call_parser:
        return []
    return ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]


def _colocated(args: argparse.Namespace, argv: list[str], gateway_url: str) -> list[Service]:
    """`pdserve serve`, its one engine sized like a decode worker (--decode-tp, --decode-gpus);
    with --api-server-count N, N of them on one port sharing one engine core process."""
    if args.prefill_tp != 1:
        raise SystemExit("pdserve up: --colocated runs one engine, sized by --decode-tp and "
                         "--decode-gpus: drop --prefill-tp")
    [env] = _gpu_envs(args, "decode", 1)
    argv += ["--tensor-parallel-size", str(args.decode_tp), "--host", args.host, "--port",
             str(args.port)]
    env = {**env, **_key_env(args)}
    if args.api_server_count == 1:
        return [Service("gateway", argv, f"http:{gateway_url}/ready", env=env)]
    if args.engine_core == "thread":
        raise SystemExit("pdserve up: --colocated --api-server-count N shares one engine core "
                         "process between N servers: drop --engine-core thread")
    # the first server starts the engine core; the others join it; all serve one port
    core = os.path.join(tempfile.gettempdir(), f"pdserve-engine-core-{args.port}.sock")
    argv += ["--reuse-port"]
    return [Service("gateway" if i == 0 else f"gateway-{i}",
                    [*argv, *(["--engine-core-listen", core] if i == 0 else
                              ["--engine-core-address", core])],
                    f"http:{gateway_url}/ready", env=env)
            for i in range(args.api_server_count)]


def _gpu_envs(args: argparse.Namespace, role: str, count: int) -> list[dict[str, str]]:
    """Each of a role's `count` workers' CUDA_VISIBLE_DEVICES: worker i takes --<role>-tp GPUs
    of --<role>-gpus from position i*tp on, wrapping around; none (the shell's) without a list.
    Its own come first (its ranks run on cuda:0..tp-1); the other GPUs the cluster lists follow,
    visible so that the cuda_ipc data plane can map a peer's KV pool on them (a prefill worker
    writes into a decode worker's blocks on another GPU over NVLink/PCIe, not through gRPC).

        --decode-gpus 1,2,3 --decode-tp 2  ->  decode-0 "1,2,3"  decode-1 "3,1,2"  decode-2 "2,3,1"
        --prefill-gpus 0 --decode-gpus 1   ->  prefill-0 "0,1"  decode-0 "1,0"
    """
    flag, value, tp = f"--{role}-gpus", getattr(args, f"{role}_gpus"), getattr(args, f"{role}_tp")
    gpus = _gpu_list(value)
    if any(not g.isdigit() for g in gpus):
        raise SystemExit(f"pdserve up: {flag} takes GPU indices such as 0 or 0,1, got {value!r}")
    if tp < 1:
        raise SystemExit(f"pdserve up: --{role}-tp must be >= 1, got {tp}")
    if gpus and len(gpus) < tp:
        raise SystemExit(f"pdserve up: --{role}-tp {tp} needs {tp} GPUs per worker but {flag} "
                         f"lists {len(gpus)}: {','.join(gpus)}")
    if not gpus:
        return [{} for _ in range(count)]
    listed = list(dict.fromkeys(_gpu_list(args.prefill_gpus) + _gpu_list(args.decode_gpus)))
    envs = []
    for i in range(count):
        own = list(dict.fromkeys(gpus[(i * tp + k) % len(gpus)] for k in range(tp)))
        envs.append({"CUDA_VISIBLE_DEVICES": ",".join(own + [g for g in listed if g not in own])})
    return envs


def _own_gpu(env: dict[str, str]) -> str:
    """A worker's first GPU in its environment ("": the default device, no list given)."""
    return env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0]


def _step_marks_folders(port: int, envs: dict[str, list[dict[str, str]]]) -> dict[str, str]:
    """A --shared-gpu-step-marks folder for each GPU a prefill and a decode worker share (the
    prefill's steps marked there, for the decode's --shared-gpu-pace-ms), named by the
    gateway's port so that two clusters on one host keep theirs apart."""
    shared = {_own_gpu(e) for e in envs["prefill"]} & {_own_gpu(e) for e in envs["decode"]}
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return {g: os.path.join(base, f"pdserve-step-marks-{port}-{g or 'default'}")
            for g in sorted(shared)}


def remove_step_marks(services: list[Service]) -> None:
    """The --shared-gpu-step-marks folders handed to `services`, removed once they stopped:
    a worker killed mid-way leaves its mark's file behind."""
    flag = "--shared-gpu-step-marks"
    for folder in {s.argv[s.argv.index(flag) + 1] for s in services if flag in s.argv}:
        shutil.rmtree(folder, ignore_errors=True)


def _gpu_list(value: str) -> list[str]:
    return [g.strip() for g in value.split(",") if g.strip()]


def _cluster_flags(args: argparse.Namespace) -> list[str]:
    """The Redis namespace and the gRPC TLS flags, handed to every service alike."""
    flags = ["--redis-namespace", args.redis_namespace]
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name"):
        value = getattr(args, flag[2:].replace("-", "_"))
        flags += [flag, value] if value else []
    return flags


def redis_argv(port: int) -> list[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("pdserve up: redis-server not found on PATH "
                         "(apt-get install redis-server, or pass --redis-url)")
    workdir = tempfile.mkdtemp(prefix="pdserve-redis-")
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir]


def start(service: Service) -> None:
    service.proc = subprocess.Popen(
        service.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **service.env},
    )
    threading.Thread(target=_prefix_lines, args=(service.name, service.proc.stdout),
                     daemon=True).start()


def _prefix_lines(name: str, stream: IO[str] | None) -> None:
    if stream is None:
        return
    for line in stream:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def healthy(service: Service, tls: TLSConfig = PLAINTEXT) -> bool:
    kind, _, target = service.health.partition(":")
    if kind == "redis":
        try:
            with socket.create_connection(("127.0.0.1", int(target)), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
    if kind == "grpc":
        import asyncio

        from pdserve.cluster.grpc_server import check_health

        return asyncio.run(check_health(target, tls=tls))
    import urllib.request

    try:
        with urllib.request.urlopen(target, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(service: Service, deadline: float, tls: TLSConfig = PLAINTEXT) -> None:
    while time.monotonic() < deadline:
        if service.proc is not None and service.proc.poll() is not None:
            raise RuntimeError(f"{service.name} exited with code {service.proc.returncode}")
        if healthy(service, tls):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{service.name} did not become healthy in time")


def stop_all(services: list[Service], grace_s: float = 15.0) -> None:
    """Stop in three tiers, each SIGTERMed at once and waited for (SIGKILL after `grace_s`):
    the gateways (no new requests), then the workers and the tokenizer together (each drains
    what it holds; none needs another to), then Redis (the workers deregister there)."""
    tiers: list[list[Service]] = [[], [], []]
    for s in services:
        tiers[0 if s.name.startswith("gateway") else 2 if s.name == "redis" else 1].append(s)
    for tier in tiers:
        running = [s for s in tier if s.proc is not None and s.proc.poll() is None]
        for s in running:
            s.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + grace_s
        for s in running:
            assert s.proc is not None
            try:
                s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()


@contextlib.contextmanager
def kill_on_signal(services: list[Service]) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM SIGKILL every service still running instead of
    interrupting it: a second Ctrl-C during the graceful stop ends the cluster at once, and
    leaves no service behind (the stop's waits then return)."""
    def kill_all(signum: int, frame: object) -> None:
        print("pdserve up: stopping now (SIGKILL)", file=sys.stderr)
        for s in services:
            if s.proc is not None and s.proc.poll() is None:
                s.proc.kill()

    before = {sig: signal.signal(sig, kill_all) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    reserve(args.port)  # the gateway's, bound last: no other service may draw it meanwhile
    redis_port = None if (args.redis_url or args.colocated) else free_port()
    redis_url = args.redis_url or (f"redis://127.0.0.1:{redis_port}/0" if redis_port else "")
    services = plan(args, redis_url, redis_port)
    tls = tls_from_args(args)  # the health probes dial the services as the gateway does
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        deadline = time.monotonic() + args.startup_timeout
        for s in services:
            start(s)
            if s.name in ("redis", "tokenizer"):
                wait_healthy(s, deadline, tls)
        for s in services:
            wait_healthy(s, deadline, tls)
        _announce(args, redis_url, services)
        return _watch(services)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("pdserve up: stopping every service ...", file=sys.stderr)
        with kill_on_signal(services):  # a second Ctrl-C / SIGTERM: no grace left
            stop_all(services)
        remove_step_marks(services)
        cluster_file().unlink(missing_ok=True)


def _watch(services: list[Service]) -> int:
    """Until a core service (Redis, tokenizer, gateway) exits. A worker that exits is reported
    and left out: the registry drops it and the gateway routes around it."""
    reported: set[str] = set()
    while True:
        for s in services:
            if s.proc is None or s.proc.poll() is None or s.name in reported:
                continue
            if s.name in ("redis", "tokenizer") or s.name.startswith("gateway"):
                print(f"pdserve up: {s.name} exited ({s.proc.returncode}); stopping the cluster",
                      file=sys.stderr)
                return 1
            reported.add(s.name)
            print(f"pdserve up: {s.name} exited ({s.proc.returncode}); serving without it",
                  file=sys.stderr)
        time.sleep(0.5)


def _announce(args: argparse.Namespace, redis_url: str, services: list[Service]) -> None:
    url = f"http://{args.host}:{args.port}"
    info = {"gateway": url, "redis_url": redis_url,
            "pids": {s.name: s.proc.pid for s in services if s.proc is not None}}
    path = cluster_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2))
    mode = "colocated" if args.colocated else f"{args.prefill} prefill + {args.decode} decode"
    auth = " -H 'Authorization: Bearer <--api-key>'" if args.api_key else ""
    print(f"""
pdserve is up ({mode}): OpenAI API at {url}/v1
  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
  pdserve status        (workers and their load)
Ctrl-C stops everything.
""", flush=True)
