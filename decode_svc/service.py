"""The Decode gRPC servicer: thin — decode the message, delegate to the engine or the KV
receiver, encode. Errors are mapped to status codes by the shared interceptor."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from decode_svc.convert import chunk_from_wire, delta_to_pb, pool_info_to_pb
from decode_svc.generate_streams import GenerateStreams
from decode_svc.push_streams import PushStreams
from decode_svc.receiver import KVReceiver
from engine import handover_trace
from engine.async_engine import AsyncLLMEngine
from pdserve.cluster.cancel import CancelWatch, NoCancelWatch
from pdserve.cluster.convert import load_to_pb, request_lora, sampling_params_from_pb
from pdserve.cluster.drain import DrainGate
from pdserve.cluster.lora_service import LoRARpcs
from protos import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(LoRARpcs, decode_pb2_grpc.DecodeServicer):
    def __init__(
        self, engine: AsyncLLMEngine, receiver: KVReceiver, kv_timeout_s: float,
        cancels: CancelWatch | NoCancelWatch, gate: DrainGate | None = None,
    ):
        self.engine = engine
        self.receiver = receiver
        self.kv_timeout_s = kv_timeout_s
        self.cancels = cancels
        self.gate = gate or DrainGate()  # GenerateStreams stops admitting when it closes

    async def Generate(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        params = sampling_params_from_pb(request.params)
        request_id, prompt = request.request_id, list(request.prompt_token_ids)
        prior = list(request.prior_output_token_ids)
        lora = request_lora(request)  # loaded on demand by the engine (ValueError: bad)
        cancelled = self.cancels.check_soon(request_id)  # beside the reservation
        if request.prefill_locally:
            await cancelled
            outputs = self.engine.generate(prompt, params, request_id, prior, lora_request=lora)
        else:
            if not await self.receiver.expect(request_id, prompt, params, prior, lora):
                logger.info("[%s] aborted while waiting for free KV blocks", request_id)
                yield decode_pb2.GenerateResponse(finish_reason="abort")
                return
            try:
                await cancelled  # RequestCancelled: its cancellation came before the request
                # blocks reserved: the push may start, skipping those held here already,
                # writing into them at once over a data plane (the grant)
                grant = self.receiver.grant(request_id)
                yield decode_pb2.GenerateResponse(
                    cached_blocks=self.receiver.cached_blocks(request_id),
                    kv_target=None if grant is None else common_pb2.KVTargetGrant(
                        pool_id=grant[0], block_ids=grant[1], push_id=grant[2]))
                arrived = await self.receiver.wait(request_id, self.kv_timeout_s)
            except BaseException:
                await self.receiver.drop(request_id)
                raise
            if not arrived:  # aborted while waiting (Abort rpc, a cancellation in Redis)
                logger.info("[%s] aborted while waiting for its KV", request_id)
                yield decode_pb2.GenerateResponse(finish_reason="abort")
                return
            outputs = self.engine.stream(request_id)
        finished = False
        hits_told = not request.prefill_locally  # else: with its first tokens
        async with aclosing(outputs) as stream:
            async for out in stream:
                finished = out.finished
                msg = delta_to_pb(out)
                if not hits_told and out.outputs[0].token_ids:
                    msg.num_cached_tokens, hits_told = out.num_cached_tokens, True
                if msg.token_ids:
                    handover_trace.mark(request_id, "yield")
                yield msg
        if not finished:  # aborted here (Abort rpc, a cancellation in Redis)
            logger.info("[%s] aborted", request_id)
            yield decode_pb2.GenerateResponse(finish_reason="abort")

    async def GenerateStreams(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateStreamsReply]:
        streams = GenerateStreams(self.Generate, lambda: self.gate.admitting, self.gate.closing)
        async with aclosing(streams.serve(request_iterator)) as replies:
            async for reply in replies:
                yield reply

    async def PushKV(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        """Its messages come as the bytes grpc received (`add_to_server`)."""
        received = await self.receiver.receive(
            chunk_from_wire(message) async for message in request_iterator)
        return decode_pb2.PushKVResponse(bytes_received=received)

    async def PushKVStreams(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.KVStreamsReply]:
        async with aclosing(PushStreams(self.receiver).serve(request_iterator)) as replies:
            async for reply in replies:
                yield reply

    async def DescribeKV(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        info = await asyncio.to_thread(self.receiver.describe, list(request.transports))
        return pool_info_to_pb(info)

    async def KVTarget(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        block_ids, push_id = await self.receiver.target(request.request_id, request.pool_id,
                                                        request.transport)
        return decode_pb2.KVTargetReply(block_ids=block_ids, push_id=push_id)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        found = await self.receiver.drop(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return load_to_pb("decode", await self.engine.stats())


def add_to_server(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    """Register the Decode service, PushKV without a request deserializer: `chunk_from_wire`
    views each slab's bytes in place, where reading protobuf's `.data` copies them into fresh
    memory (measured: 4 MiB pushes ~0.45 -> ~0.8 of raw grpcio on a 2-core CPU box)."""
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, _RawPushKV(server))


class _RawPushKV:
    """`server` as the generated registration sees it: PushKV's handler loses its request
    deserializer, the other rpcs' are kept."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        handlers = {**handlers,
                    "PushKV": handlers["PushKV"]._replace(request_deserializer=None)}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, handlers),))
        self.server.add_registered_method_handlers(service, handlers)

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """The generated generic handler is replaced by the one built above."""
