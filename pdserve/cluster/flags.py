"""Service flags with environment fallbacks, named the same everywhere.

`--kv-cache-memory` reads `PDSERVE_KV_CACHE_MEMORY` when not given; the helm chart's values and
the docs use these names too. Read at parse time, never at import.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "PDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, default: Any = None, **kw: Any) -> None:
    """`parser.add_argument(flag)` whose default comes from PDSERVE_<FLAG> when set."""
    env = os.environ.get(env_name(flag))
    value = default
    if env is not None and kw.get("action") == "store_true":
        value = env.lower() in ("1", "true", "yes")
    elif env is not None:
        value = kw.get("type", str)(env)
    help_text = kw.pop("help", "")
    kw["help"] = f"{help_text} [env {env_name(flag)}; default {default}]".strip()
    parser.add_argument(flag, default=value, **kw)


def add_common_flags(parser: argparse.ArgumentParser, port: int) -> None:
    """Flags every service takes: where to listen, the Redis URL, the log level."""
    add_flag(parser, "--host", "127.0.0.1", help="interface to bind")
    add_flag(parser, "--port", port, type=int, help="port to listen on")
    add_flag(parser, "--advertise-address", "", help="host:port others use (default host:port)")
    add_flag(parser, "--redis-url", "", help="Redis for the registry and request state")
    add_redis_namespace_flag(parser)
    add_flag(parser, "--log-level", "info", help="debug, info, warning, error")
    add_flag(parser, "--drain-timeout", 10.0, type=float,
             help="seconds in-flight calls get to finish after SIGTERM (a worker leaves the "
                  "registry, admits for min(1 s, a quarter of this) more, then only drains)")
    add_tls_flags(parser)


def add_redis_namespace_flag(parser: argparse.ArgumentParser) -> None:
    """The prefix of every Redis key (pdserve.cluster.state.Keys): clusters sharing one Redis
    never see each other's requests or workers."""
    add_flag(parser, "--redis-namespace", "pdserve",
             help="prefix of this cluster's Redis keys (letters, digits, _ . -)")


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """gRPC TLS (pdserve.cluster.tls): this process's certificate and key, the peers' CA, the
    name servers' certificates carry."""
    add_flag(parser, "--tls-cert", "", help="PEM certificate chain: serve and dial gRPC over TLS")
    add_flag(parser, "--tls-key", "", help="PEM private key of --tls-cert")
    add_flag(parser, "--tls-ca", "",
             help="PEM CA of the peers: verify servers; a server requires client certificates")
    add_flag(parser, "--tls-server-name", "",
             help="name every server's certificate must carry (default: the address dialled)")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--model", None, help="local HF folder or .gguf (default: bundled SmolLM2)")
    add_flag(parser, "--served-model-name", "", help="model name in the OpenAI API")
    add_flag(parser, "--max-model-len", None, type=int, help="context length served")


def add_chat_template_flag(parser: argparse.ArgumentParser) -> None:
    """--chat-template: where conversations are rendered (the tokenizer service, or the
    colocated `pdserve serve`); tokenizer_svc/chat_template.py says which template wins."""
    add_flag(parser, "--chat-template", "",
             help="Jinja chat template file replacing the model's own (default: the model's; "
                  "requests with tools on a ChatML template that cannot render them use the "
                  "shipped chatml_tools.jinja)")


def add_generate_streams_flag(parser: argparse.ArgumentParser) -> None:
    """--generate-streams, a gateway's (gateway/generate_streams.py)."""
    add_flag(parser, "--generate-streams", "shared", choices=["shared", "per-request"],
             help="the token streams from each decode worker: shared (one GenerateStreams "
                  "call per worker, a message per decode step for all its requests) or "
                  "per-request (a Generate call each, a message per request per step)")


def add_prefill_streams_flag(parser: argparse.ArgumentParser) -> None:
    """--prefill-streams, a gateway's (gateway/prefill_calls.py)."""
    add_flag(parser, "--prefill-streams", "shared", choices=["shared", "per-request"],
             help="the Prefill and Reserved calls to each prefill worker: shared (messages on "
                  "one PrefillStreams call per worker, kept open) or per-request (a call each)")


def add_stream_interval_flag(parser: argparse.ArgumentParser) -> None:
    """--stream-interval, an engine's (engine/config.py SchedulerConfig.stream_interval)."""
    add_flag(parser, "--stream-interval", 1, type=int,
             help="a streamed request's tokens leave the engine with its first one, then every "
                  "this many, and at its end: fewer messages per token on every hop after the "
                  "engine (decode worker, gateway, client), larger bursts (vLLM's flag)")


def add_engine_core_flag(parser: argparse.ArgumentParser) -> None:
    """--engine-core, the colocated server's (engine/core_client.py)."""
    add_flag(parser, "--engine-core", "process", choices=["thread", "process"],
             help="where the engine's step loop runs: a thread of the server's process "
                  "(sharing its interpreter lock with the HTTP server), or a process of its own "
                  "(vLLM V1's EngineCore)")
    add_flag(parser, "--engine-core-listen", "",
             help="with --engine-core process: a Unix socket path at which other servers join "
                  "this server's engine core (`--engine-core-address`)")
    add_flag(parser, "--engine-core-address", "",
             help="join the engine core another server listens for at this Unix socket path "
                  "instead of starting one (its engine flags then apply; this server's are "
                  "unused)")


def add_worker_engine_core_flag(parser: argparse.ArgumentParser, role: str) -> None:
    """--engine-core, a decode or prefill worker's (decode_svc/engine_core.py,
    prefill_svc/engine_core.py), resolved by pdserve.cluster.worker.worker_engine_core."""
    shares = {"decode": "the gRPC server and the token streams",
              "prefill": "the gRPC server and the KV pushes"}[role]
    measured = {"decode": "1.25x the output tokens/s at saturation on an H200",
                "prefill": "the split's output tokens/s at saturation 1.19x the thread's on an "
                           "H100; a push then starts at the request's first token, not while "
                           "its prompt is computed"}[role]
    add_flag(parser, "--engine-core", "auto", choices=["auto", "thread", "process"],
             help=f"where the {role} engine's step loop runs: a thread of the worker's process "
                  f"(sharing its interpreter lock with {shares}), or a process of its own "
                  f"(not with --tensor-parallel-size > 1); auto: a process on a GPU without "
                  f"tensor parallelism ({measured}; docs/loadtest.md), a thread on the CPU "
                  f"(where the decode core cost 4-5%% on 2 cores)")


def add_kv_push_streams_flag(parser: argparse.ArgumentParser) -> None:
    """--kv-push-streams, a prefill worker's (prefill_svc/push_streams.py)."""
    add_flag(parser, "--kv-push-streams", "shared", choices=["shared", "per-request"],
             help="shared: the data-plane pushes (cuda_ipc, nixl) to a decode worker share one "
                  "PushKVStreams call; per-request: a PushKV stream each (grpc pushes always)")


def add_shared_gpu_pace_flags(parser: argparse.ArgumentParser) -> None:
    """--shared-gpu-pace-ms and --shared-gpu-pace-tokens, a decode worker's (engine/config.py
    SchedulerConfig.shared_gpu_pace_ms)."""
    add_flag(parser, "--shared-gpu-pace-ms", 4.0, type=float,
             help="a decode worker sharing its GPU with a prefill worker: while a prefill step "
                  "is marked in --shared-gpu-step-marks (a lone prompt's), or while the prompts "
                  "reserved here and not yet arrived hold --shared-gpu-pace-tokens tokens or "
                  "more, start a step at most once every this many milliseconds, leaving the "
                  "GPU to the prefill (each decode step reads every weight); 0: never held")
    add_flag(parser, "--shared-gpu-pace-tokens", 0, type=int,
             help="the prompt tokens on their way from which --shared-gpu-pace-ms holds "
                  "(0: never by tokens, the marks alone)")


def add_shared_gpu_step_marks_flag(parser: argparse.ArgumentParser) -> None:
    """--shared-gpu-step-marks, a prefill or decode worker's (engine/gpu_step_marks.py)."""
    add_flag(parser, "--shared-gpu-step-marks", "",
             help="a folder for the workers sharing this worker's GPU: a prefill worker marks "
                  "each step in flight there; a decode worker with --shared-gpu-pace-ms also "
                  "holds its steps while one is marked (pdserve up sets it where a prefill and "
                  "a decode worker share a GPU); empty: none")


def add_kv_doorbell_flag(parser: argparse.ArgumentParser) -> None:
    """--kv-doorbell, a decode worker's (pdserve/transport/doorbell.py)."""
    add_flag(parser, "--kv-doorbell", "on", choices=["on", "off"],
             help="on: a data-plane push from this host commits its request through a Unix "
                  "datagram the engine thread reads between steps, ahead of its gRPC commit "
                  "(pdserve/transport/doorbell.py); off: the gRPC commit alone")


def add_kv_transport_flag(parser: argparse.ArgumentParser) -> None:
    """--kv-transport: how KV bytes move between prefill and decode workers
    (pdserve/transport/)."""
    add_flag(parser, "--kv-transport", "auto", choices=["auto", "grpc", "cuda_ipc", "nixl"],
             help="KV data plane: auto (cuda_ipc between CUDA workers of one host, nixl across "
                  "hosts when installed, else grpc), grpc, cuda_ipc, nixl")
