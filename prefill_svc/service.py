"""The Prefill gRPC servicer: compute the prompt while its KV streams to the named decode
worker, answer with the first token at once, free the blocks when the decode worker
acknowledges the push (or when anything goes wrong).

    Prefill ─▶ push opened (header) ─▶ engine computes, notes final layer groups ─▶ slabs go
            ─▶ first token: answered, and the push's commit follows the last slabs
            ─▶ PushKV reply (or failure, abort, lease expiry): blocks released
    a request that ends at its first token (eos, stop, max_tokens 1) aborts its push: the
    decode worker frees its reservation
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from engine.async_engine import AsyncLLMEngine
from engine.lora import LoRARequest
from engine.outputs import RequestOutput
from pdserve.cluster.cancel import CancelWatch, NoCancelWatch
from pdserve.cluster.convert import load_to_pb, request_lora, sampling_params_from_pb
from pdserve.cluster.drain import DrainGate
from pdserve.cluster.lora_service import LoRARpcs
from prefill_svc.convert import first_logprobs, response_to_pb
from prefill_svc.core_client import PrefillCoreClient
from prefill_svc.prefill_streams import PrefillStreams
from prefill_svc.push import KVPush
from prefill_svc.sender import KVSender
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)
NOTES_PER_STEP = 8  # KV progress notes per step and request: layer groups of L / 8 layers


class PrefillServicer(LoRARpcs, prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self, engine: AsyncLLMEngine | PrefillCoreClient, sender: KVSender,
        cancels: CancelWatch | NoCancelWatch, num_layers: int, gate: DrainGate | None = None,
    ):
        self.engine = engine
        self.sender = sender
        self.cancels = cancels
        self.pushes: dict[str, asyncio.Task] = {}
        self.waiting: dict[str, KVPush] = {}  # pushes opened before their decode reservation
        self.early = EarlyReservations()  # reservations told before their Prefill came
        self.num_layers = num_layers
        self.layers_per_group = max(1, -(-self.num_layers // NOTES_PER_STEP))
        self.gate = gate or DrainGate()  # PrefillStreams stops admitting when it closes

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.monotonic()
        params = sampling_params_from_pb(request.params)
        request_id, prompt = request.request_id, list(request.prompt_token_ids)
        prior = list(request.prior_output_token_ids)  # a migrated request's earlier outputs
        lora = request_lora(request)  # loaded on demand by the engine (ValueError: bad)
        cancelled = self.cancels.check_soon(request_id)  # awaited before the first token leaves
        push = None
        pending = request.decode_reservation_pending
        if request.decode_address and params.max_tokens != len(prior) + 1:  # else: no KV to ship
            grant = request.decode_kv_target if request.HasField("decode_kv_target") else None
            push = self._start_push(request_id, len(prompt) + len(prior), request.decode_address,
                                    request.decode_cached_blocks, grant, pending)
        try:
            out = await self._first_token(request_id, prompt, params, prior, push, lora)
        except BaseException:
            self._stop_push(request_id)  # the engine freed the blocks
            raise
        try:
            await cancelled  # RequestCancelled: its cancellation came before the request
        except BaseException:
            self._stop_push(request_id)
            await self.engine.release(request_id)
            raise
        c = out.outputs[0]
        finish = c.finish_reason if c.finish_reason == "stop" else ""
        if not finish and params.max_tokens == len(prior) + 1:
            finish = "length"
        logger.info("[%s] prefilled %d tokens (%d cached) in %.1f ms%s at %.4f, first token %d%s",
                    request_id, len(prompt), out.num_cached_tokens,
                    1e3 * (time.monotonic() - start), _engine_parts(start, out), start,
                    c.token_ids[0],
                    f", finished: {finish}" if finish else f", KV to {request.decode_address}")
        if push is not None and not finish and not push.ended:
            push.commit(c.token_ids[0], first_logprobs(c))
        else:  # nothing (more) to ship: end the push, free the blocks
            self._stop_push(request_id)
            await self.engine.release(request_id)
        return response_to_pb(out, finish, params.prompt_logprobs)

    async def PrefillStreams(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PrefillStreamsReply]:
        streams = PrefillStreams(self.Prefill, self.Reserved, lambda: self.gate.admitting,
                                 self.gate.closing)
        async with aclosing(streams.serve(request_iterator)) as replies:
            async for reply in replies:
                yield reply

    def _start_push(
        self, request_id: str, num_tokens: int, decode_address: str, skip_blocks: int,
        grant: Any = None, pending: bool = False,
    ) -> KVPush:
        """Open the request's push before the engine sees it, so no note is missed. The first
        `skip_blocks` blocks are not pushed: the decode worker holds them. `grant`: the decode
        worker's KVTargetGrant (its reserved blocks for a data-plane push), if it gave one.
        `pending`: the decode worker is reserving still: both come in `Reserved` (maybe come
        already), and the push sends nothing before."""
        if request_id in self.pushes:  # its push would free the other's blocks
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            push = self.sender.new_push(request_id, num_tokens, skip_blocks,
                                        reserved=not pending)
        except ValueError as exc:
            raise ValueError(f"decode_cached_blocks: {exc}") from None
        push.grant = grant
        told = self.early.pop(request_id) if pending else None
        if told is not None:
            try:
                push.reserve(*told)
            except ValueError as exc:
                raise ValueError(f"decode_cached_blocks: {exc}") from None
        group = (self.num_layers if self.sender.whole_steps(decode_address, num_tokens)
                 else self.layers_per_group)  # a data plane writes a step's KV at its end
        push.watch = self.engine.watch_kv(push.on_progress, group)
        self.pushes[request_id] = asyncio.create_task(self._push(decode_address, push))
        if not push.reservation.is_set():
            self.waiting[request_id] = push  # until `Reserved`, or the push's end
        return push

    def _stop_push(self, request_id: str) -> None:
        task = self.pushes.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _first_token(
        self, request_id: str, prompt: list[int], params: Any, prior: list[int],
        push: KVPush | None, lora: LoRARequest | None = None,
    ) -> RequestOutput:
        final = None
        watch = None if push is None else push.watch
        async with aclosing(self.engine.generate(prompt, params, request_id, prior,
                                                 kv_watch=watch, lora_request=lora)) as outs:
            async for out in outs:
                final = out
        assert final is not None and final.finished
        return final

    async def _push(self, decode_address: str, push: KVPush) -> None:
        """Ship the KV as it is computed, then free the held blocks whatever happened (the
        servicer frees them instead when the push ends before the request is held)."""
        rid = push.request_id
        try:
            sent = await self.sender.send(decode_address, push)
            logger.info("[%s] KV pushed: %d blocks (%d held there already), %d bytes, %d before "
                        "the first token", rid, push.num_blocks - push.skip_blocks,
                        push.skip_blocks, sent, push.bytes_before_first_token)
        except asyncio.CancelledError:
            logger.info("[%s] KV push aborted", rid)
        except Exception as exc:  # noqa: BLE001 - the decode side fails the request
            logger.warning("[%s] KV push to %s failed: %s", rid, decode_address, exc)
        finally:
            push.ended = True
            if self.pushes.get(rid) is asyncio.current_task():
                del self.pushes[rid]
            if self.waiting.get(rid) is push:
                del self.waiting[rid]
            await self.engine.release(rid)

    async def Reserved(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        rid = request.request_id
        grant = request.decode_kv_target if request.HasField("decode_kv_target") else None
        told = (request.decode_cached_blocks, grant)
        push = self.waiting.pop(rid, None)
        if push is None:
            self.early.add(rid, told)
            return prefill_pb2.ReservedResponse(found=False)
        try:
            push.reserve(*told)
        except ValueError as exc:
            raise ValueError(f"decode_cached_blocks: {exc}") from None
        return prefill_pb2.ReservedResponse(found=True)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return common_pb2.AbortResponse(found=await self.abort(request.request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop the request's prefill or push and free its blocks. True if it was here."""
        self.early.pop(request_id)
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
        released = await self.engine.release(request_id)
        return released or task is not None

    async def GetLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return load_to_pb("prefill", await self.engine.stats())


def _engine_parts(start: float, out: RequestOutput) -> str:
    """Where a prefill's time went, from the engine's milestones (time.monotonic: one clock for
    every process of the host): the request's way into the engine, its wait for a step, its
    steps to the first token, the token's way back here."""
    m, now = out.metrics, time.monotonic()
    if m is None or m.first_scheduled_time is None or m.first_token_time is None:
        return ""
    return (f" (into the engine {1e3 * (m.arrival_time - start):.1f}, waiting "
            f"{1e3 * (m.first_scheduled_time - m.arrival_time):.1f}, steps "
            f"{1e3 * (m.first_token_time - m.first_scheduled_time):.1f}, back "
            f"{1e3 * (now - m.first_token_time):.1f})")


class EarlyReservations:
    """Reservations told (`Reserved`) before their Prefill came: the gateway sends both at
    once, and either may be handled first. Each is kept at most `keep_s`; a Prefill that never
    comes (its gateway gave up) leaves nothing behind for longer."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self.keep_s = keep_s
        self._told: dict[str, tuple[float, tuple[int, Any]]] = {}

    def add(self, request_id: str, told: tuple[int, Any]) -> None:
        now = time.monotonic()
        for rid in [r for r, (at, _) in self._told.items() if now - at > self.keep_s]:
            del self._told[rid]
        self._told[request_id] = (now, told)

    def pop(self, request_id: str) -> tuple[int, Any] | None:
        entry = self._told.pop(request_id, None)
        return None if entry is None else entry[1]
