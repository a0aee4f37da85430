"""The Prefill gRPC servicer: compute the prompt, answer with the first token at once, ship the
KV to the named decode worker in the background, free the blocks when it acknowledges."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any

import grpc

from engine.async_engine import AsyncLLMEngine
from engine.outputs import RequestOutput
from pdserve.cluster.cancel import CancelWatch, NoCancelWatch
from pdserve.cluster.convert import load_to_pb, sampling_params_from_pb
from prefill_svc.convert import first_logprobs, response_to_pb
from prefill_svc.sender import KVSender, KVTransfer
from protos import common_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self, engine: AsyncLLMEngine, sender: KVSender, cancels: CancelWatch | NoCancelWatch
    ):
        self.engine = engine
        self.sender = sender
        self.cancels = cancels
        self.pushes: dict[str, asyncio.Task] = {}

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        params = sampling_params_from_pb(request.params)
        request_id, prompt = request.request_id, list(request.prompt_token_ids)
        prior = list(request.prior_output_token_ids)  # a migrated request's earlier outputs
        await self.cancels.check(request_id)
        out = await self._first_token(request_id, prompt, params, prior)
        c = out.outputs[0]
        finish = c.finish_reason if c.finish_reason == "stop" else ""
        if not finish and params.max_tokens == len(prior) + 1:
            finish = "length"
        logger.info("[%s] prefilled %d tokens (%d cached), first token %d%s", request_id,
                    len(prompt), out.num_cached_tokens, c.token_ids[0],
                    f", finished: {finish}" if finish else f", KV to {request.decode_address}")
        if finish or not request.decode_address:
            await self.engine.call(self.engine.engine.release, request_id)
        else:
            transfer = KVTransfer(request_id, len(prompt) + len(prior), [], c.token_ids[0],
                                  first_logprobs(c))
            task = asyncio.create_task(self._push(request.decode_address, transfer))
            self.pushes[request_id] = task
        return response_to_pb(c, out.num_cached_tokens, finish)

    async def _first_token(
        self, request_id: str, prompt: list[int], params: Any, prior: list[int]
    ) -> RequestOutput:
        final = None
        async with aclosing(self.engine.generate(prompt, params, request_id, prior)) as outs:
            async for out in outs:
                final = out
        assert final is not None and final.finished
        return final

    async def _push(self, decode_address: str, transfer: KVTransfer) -> None:
        """Ship the held blocks, then free them whatever happened."""
        rid = transfer.request_id
        try:
            transfer.block_ids = await self.engine.call(self.engine.engine.held_block_ids, rid)
            sent = await self.sender.send(decode_address, transfer)
            logger.info("[%s] KV pushed: %d blocks, %d bytes", rid, len(transfer.block_ids), sent)
        except asyncio.CancelledError:
            logger.info("[%s] KV push aborted", rid)
        except Exception as exc:  # noqa: BLE001 - the decode side fails the request
            logger.warning("[%s] KV push to %s failed: %s", rid, decode_address, exc)
        finally:
            self.pushes.pop(rid, None)
            await self.engine.call(self.engine.engine.release, rid)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return common_pb2.AbortResponse(found=await self.abort(request.request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop the request's prefill or push and free its blocks. True if it was here."""
        task = self.pushes.pop(request_id, None)
        if task is not None:
            task.cancel()
        found = await self.engine.abort(request_id)
        return found or task is not None

    async def expire(self, request_id: str) -> bool:
        """Its KV lease ran out: end the request's push (waiting for the push to stop reading
        the blocks) and free them. True if it held any."""
        task = self.pushes.pop(request_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its `finally` frees the blocks
        released = await self.engine.call(self.engine.engine.release, request_id)
        return released or task is not None

    async def GetLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return load_to_pb("prefill", await self.engine.stats())
