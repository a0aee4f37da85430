"""`pdserve tokenizer`: the tokenizer service as its own process."""

from __future__ import annotations

import argparse
import asyncio
import logging

from engine.gc_heap import serving_process_ready
from pdserve.cluster.flags import add_chat_template_flag, add_common_flags, add_model_flags
from pdserve.cluster.grpc_server import make_server, serve_until_signal, set_serving
from pdserve.cluster.registry import Heartbeat, WorkerInfo, WorkerRegistry
from pdserve.cluster.state import connect
from pdserve.cluster.tls import listen, tls_from_args
from pdserve.cluster.worker import advertise_address
from protos import tokenizer_pb2_grpc
from tokenizer_svc.service import TokenizerModel, TokenizerServicer

SERVICE = "pdserve.v1.Tokenizer"
DEFAULT_PORT = 50051
BUNDLED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_flags(parser, DEFAULT_PORT)
    add_model_flags(parser)
    add_chat_template_flag(parser)


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return BUNDLED_NAME if args.model is None else args.model


async def serve(args: argparse.Namespace) -> None:
    from engine.model_loader import resolve_model
    from tokenizer_svc.chat_template import read_template

    path = resolve_model(args.model)
    model = TokenizerModel(path, served_name(args), args.max_model_len,
                           read_template(args.chat_template))
    servicer = TokenizerServicer(model)
    server, health = await make_server(
        SERVICE, lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, s))
    listen(server, f"{args.host}:{args.port}", tls_from_args(args))
    await server.start()
    serving_process_ready("tokenizer")
    await set_serving(health, SERVICE)
    logging.getLogger(__name__).info("tokenizer serving %s on %s:%d", path, args.host, args.port)
    heartbeat = _heartbeat(args)

    async def on_stop() -> None:
        servicer.stopping.set()  # its kept-open calls end once idle: no wait for the grace
        if heartbeat is not None:
            await heartbeat.stop()

    await serve_until_signal(server, on_stop, args.drain_timeout)


def _heartbeat(args: argparse.Namespace) -> Heartbeat | None:
    """Announce this tokenizer in the registry so gateways can find it (with --redis-url)."""
    if not args.redis_url:
        return None
    address = advertise_address(args)
    info = WorkerInfo(worker_id=f"tokenizer-{address}", role="tokenizer", address=address)

    async def get_info() -> WorkerInfo:
        return info

    registry = WorkerRegistry(connect(args.redis_url), prefix=args.redis_namespace)
    heartbeat = Heartbeat(registry, get_info)
    heartbeat.start()
    return heartbeat


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
