"""The disaggregated backend: tokenizer, prefill and decode workers over gRPC.

NOTE: one generation's path (DESIGN.md, "The request's path"):

    1. pick the decode worker with the most free KV blocks and the prefill worker with the
       shortest queue, from the live registry
    2. open Decode.Generate: the decode worker reserves the prompt's blocks and acknowledges
    3. Prefill(decode_address), sent beside 2 (a migration's, after it): the first token comes
       back at once -> yielded to the client; once 2 acknowledged, Prefill.Reserved tells the
       prefill worker what it said, and the prefill worker pushes the KV to the decode worker
       in the background
    4. the decode stream carries every later token as deltas
Closing the generator early cancels the decode stream and aborts the prefill, so no worker keeps
blocks for a request nobody reads. A worker that dies (UNAVAILABLE) is routed around: a prefill
is retried on another prefill worker, a decode stream moves to another decode worker that
re-prefills the prompt plus the tokens already streamed (`prior_output_token_ids`).

The tokenizer service is `remote_tokenizer.py`'s; the worker list, routing and channels are
`worker_pool.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

import grpc

from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from engine.stop_checker import check_token_stop
from gateway.backend import (
    BackendError,
    ModelFacts,
    RequestRejected,
    TokenDelta,
    state_request_id,
)
from gateway.generate_streams import GenerateCalls
from gateway.metrics import GatewayMetrics
from gateway.prefill_calls import PrefillCalls
from gateway.remote_tokenizer import RemoteTokenizer
from gateway.worker_pool import WorkerPool
from pdserve.cluster.convert import (
    logprobs_from_pb,
    lora_to_pb,
    prompt_logprobs_from_pb,
    sampling_params_to_pb,
)
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.registry import PREFILL_BESIDE_RESERVATION, WorkerInfo, WorkerRegistry
from pdserve.cluster.routing import pick_prefill
from pdserve.cluster.tls import PLAINTEXT, TLSConfig
from protos import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class WorkerLost(BackendError):
    """A worker failed a call with UNAVAILABLE (killed, unreachable): the request may move."""

    def __init__(self, message: str, worker: WorkerInfo):
        super().__init__(message, retryable=True)
        self.worker = worker


class RemoteBackend:
    def __init__(
        self,
        tokenizer_address: str,
        registry: WorkerRegistry,
        store: Any | None = None,
        local_prefill_max_tokens: int = 0,
        timeout_s: float = 600.0,
        tls: TLSConfig = PLAINTEXT,
        max_migrations: int = 2,
        metrics: GatewayMetrics | None = None,
        routing: str = "kv_aware",
        shared_generate: bool = True,
        shared_prefill: bool = True,
    ):
        self.tokenizer = RemoteTokenizer(tokenizer_address, tls)
        prefixes = PrefixIndex(registry.client, registry.keys.prefix, registry.ttl_s)
        # the prefill and decode workers, their channels, and which gets a request
        self.pool = WorkerPool(registry, tls, routing, prefixes, metrics)
        self.store = store
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.timeout_s = timeout_s
        self.max_migrations = max_migrations  # worker failures one request may survive
        self.metrics = metrics  # counts those moves
        # the token streams: one GenerateStreams call per decode worker, or a Generate each
        self.generate_calls = GenerateCalls(shared=shared_generate)
        # Prefill and Reserved: one PrefillStreams call per prefill worker, or a call each
        self.prefill_calls = PrefillCalls(shared=shared_prefill)

    # ---- model facts and text ------------------------------------------------------------
    async def start(self) -> None:
        """Fetch the model's facts and tokenizer from the tokenizer service (once)."""
        await self.tokenizer.start()

    async def model_info(self) -> ModelFacts:
        return await self.tokenizer.start()

    def get_tokenizer(self) -> Any:
        return self.tokenizer.tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.tokenizer.tokenize(text, add_special_tokens)

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return await self.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                        chat_template, tools)

    async def ready(self) -> bool:
        if self.tokenizer.facts is None or not await self.tokenizer.healthy():
            return False
        try:
            workers = await self.pool.list()
        except BackendError:  # Redis down: not ready
            return False
        roles = {w.role for w in workers}
        return "decode" in roles and ("prefill" in roles or self.local_prefill_max_tokens > 0)

    async def workers(self) -> list[dict[str, Any]]:
        return [asdict(w) for w in await self.pool.list()]

    async def close(self) -> None:
        await self.pool.close()
        await self.tokenizer.close()

    # ---- generation ----------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prior_output_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream one sequence, after `prior_output_token_ids` when given (a resumed stream),
        under the LoRA adapter `lora_request` (None: the base model), which travels with the
        request to both workers; each loads it on demand.
        A decode worker lost mid-stream (UNAVAILABLE: killed, cut off) hands the request to
        another one, which re-prefills the prompt plus the tokens already generated and
        continues where it stopped: the client sees no gap, no repeat, no error. At most
        `max_migrations` moves (prefill retries included) per request."""
        generated: list[int] = list(prior_output_token_ids or [])
        lost: set[str] = set()  # addresses of workers that failed this request
        finished = False
        try:
            while True:
                attempt = self._attempt(request_id, prompt_token_ids, params, generated, lost,
                                        lora_request)
                try:
                    async with aclosing(attempt) as deltas:
                        async for delta in deltas:
                            generated.extend(delta.token_ids)
                            finished = delta.finish_reason is not None
                            yield delta
                    return
                except WorkerLost as exc:
                    self._count_move(request_id, exc, lost)
        finally:
            if not finished:
                await self._cancel(request_id)

    async def _attempt(
        self, request_id: str, prompt: list[int], params: SamplingParams,
        prior: list[int], lost: set[str], lora: LoRARequest | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """One try on one decode worker, continuing after `prior` (tokens already streamed).
        A prefill worker that dies is replaced here; a dead decode worker raises WorkerLost.

        Prompt logprobs are computed by a prefill worker only (a decode worker never computes
        the prompt's positions for output), whatever --local-prefill-max-tokens says; once
        tokens were streamed, the client has had them."""
        if prior:
            params = params.clone(prompt_logprobs=None)
        wants_prompt = params.prompt_logprobs is not None
        local = len(prompt) + len(prior) <= self.local_prefill_max_tokens and not wants_prompt
        name = None if lora is None else lora.lora_name
        clock = _FirstTokenClock()
        decode, prefill = await self.pool.route(local, lost, prompt + prior, name)
        clock.routed = time.monotonic()
        lora_pb = None if lora is None else lora_to_pb(lora)
        pb_params = sampling_params_to_pb(params, params.max_tokens or 1)
        decode_params = pb_params
        if wants_prompt:
            decode_params = sampling_params_to_pb(params.clone(prompt_logprobs=None),
                                                  params.max_tokens or 1)
        # the claim: the request in the router's load of its prefill worker until its first
        # token (released there), or until this attempt ends
        async with self.pool.claim(prefill) as claim, \
                self.pool.channel(decode.address) as channel:
            request = decode_pb2.GenerateRequest(
                request_id=request_id, prompt_token_ids=prompt, params=decode_params,
                prefill_locally=local, prior_output_token_ids=prior, lora=lora_pb)
            call = self.generate_calls.open(channel, request, self.timeout_s)
            prefill_done = local
            finished = False  # the request ended: at its first token or on the decode worker
            decode_ended = False  # the decode worker ended its stream itself
            notes = _Notes(self._transition, request_id)  # its phases, off the token path
            try:
                if not local:
                    if not prior and _beside_possible(prefill, decode, len(prompt)):
                        first = await self._prefill_beside_reservation(
                            request_id, prompt, pb_params, call, decode, prefill, lost, notes,
                            lora_pb, clock)
                    else:  # a migration, or a decode worker short of blocks: its prefill
                        # after the reservation (which may wait for blocks to free)
                        reserved = await self._read(call, decode)  # blocks reserved there
                        clock.reserved = time.monotonic()
                        cached, grant = _reservation(reserved)
                        first = await self._prefill_retrying(
                            request_id, prompt, pb_params, prior, decode, prefill, lost, cached,
                            notes, lora_pb, grant, clock)
                    claim.release()
                    clock.log(request_id)
                    prefill_done = True
                    finished = bool(first.finish_reason)
                    yield first
                    if finished:
                        return
                    notes.add("transferring")
                async for delta in self._decode_stream(call, decode, notes, local,
                                                       hits=not prior):
                    finished = decode_ended = delta.finish_reason is not None
                    yield delta
            finally:
                if not decode_ended:  # a failure, the client gone, or the first token ended
                    call.cancel()     # the request: the decode worker frees its reservation
                if not finished and not prefill_done and prefill is not None:
                    await self._abort(prefill, request_id)
                await notes.landed()  # before the request's end is recorded

    async def _prefill_beside_reservation(
        self, request_id: str, prompt: list[int], pb_params: Any, call: Any,
        decode: WorkerInfo, prefill: WorkerInfo | None, lost: set[str], notes: _Notes,
        lora: common_pb2.LoRAAdapter | None, clock: _FirstTokenClock,
    ) -> TokenDelta:
        """A new request's Prefill, sent while the decode worker reserves its blocks (see the
        NOTE); what the reservation says then goes to the prefill worker (Reserved), whose push
        waits for it. A prefill worker lost meanwhile: the prefill is retried after the
        reservation (`_prefill_retrying`); a decode worker lost: WorkerLost, as always.

        NOTE: why. One after the other, the reservation (Generate's first message: the decode
        worker's engine takes the request between two of its steps) was 2.7 ms of a split
        request's 18.6 to its first token at 16 req/s on an H100 (`python -m
        pdserve.bench.ttft_breakdown`, 2026-12-06); the prefill's own time (7.2 ms there) is
        longer, so beside it the reservation costs the first token nothing. The push, the only
        part that needs the reserved blocks, starts after both."""
        assert prefill is not None
        notes.add("prefilling", prefill_worker=prefill.address, decode_worker=decode.address)
        clock.beside = True
        prefilling = asyncio.ensure_future(self._prefill(
            prefill, request_id, prompt, pb_params, [], decode.address, lora=lora,
            pending=True, clock=clock))
        prefilling.add_done_callback(lambda f: f.cancelled() or f.exception())
        telling: asyncio.Future[None] | None = None
        try:
            reserved = await self._read(call, decode)  # blocks reserved there
            clock.reserved = time.monotonic()
            cached, grant = _reservation(reserved)
            telling = asyncio.ensure_future(self._tell_reserved(prefill, request_id, cached,
                                                                grant))
            telling.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                first = await prefilling
                await telling  # told before the first token leaves: else it is prefilled anew
                return first
            except WorkerLost as exc:
                if exc.worker.address != prefill.address:
                    raise
                self._count_move(request_id, exc, lost)
            return await self._prefill_retrying(request_id, prompt, pb_params, [], decode,
                                                await self._another_prefill(lost, lora), lost,
                                                cached, notes, lora, clock=clock)
        finally:
            prefilling.cancel()  # done already unless this failed
            if telling is not None:
                telling.cancel()

    async def _tell_reserved(self, prefill: WorkerInfo, request_id: str, cached: int,
                             grant: common_pb2.KVTargetGrant | None) -> None:
        request = prefill_pb2.ReservedRequest(request_id=request_id,
                                              decode_cached_blocks=cached,
                                              decode_kv_target=grant)
        async with self.pool.channel(prefill.address) as channel:
            try:
                await self.prefill_calls.reserved(channel, request, self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise await self._error(exc, prefill) from exc

    async def _prefill_retrying(
        self, request_id: str, prompt: list[int], pb_params: Any, prior: list[int],
        decode: WorkerInfo, prefill: WorkerInfo | None, lost: set[str], decode_cached: int,
        notes: _Notes, lora: common_pb2.LoRAAdapter | None = None,
        grant: common_pb2.KVTargetGrant | None = None, clock: _FirstTokenClock | None = None,
    ) -> TokenDelta:
        """Prefill on `prefill`; if it dies, on another one, while the request's move budget
        lasts. The decode worker's reservation stays: a push cut off by the dead worker leaves
        the blocks reserved, and the new prefill worker pushes into them. `decode_cached`: the
        leading blocks the decode worker holds already (not pushed). `grant`: the decode
        worker's blocks granted to the first data-plane push: the first attempt's alone (a
        retry asks KVTarget, which supersedes the dead worker's push). Each attempt's
        "prefilling" goes to `notes`: recorded while the prefill runs, before any later phase."""
        while True:
            assert prefill is not None
            notes.add("prefilling", prefill_worker=prefill.address, decode_worker=decode.address)
            try:
                return await self._prefill(prefill, request_id, prompt, pb_params, prior,
                                           decode.address, decode_cached, lora, grant,
                                           clock=clock)
            except WorkerLost as exc:
                self._count_move(request_id, exc, lost)
            grant = None
            prefill = await self._another_prefill(lost, lora)

    async def _another_prefill(self, lost: set[str],
                               lora: common_pb2.LoRAAdapter | None) -> WorkerInfo:
        """A prefill worker to retry on, none of `lost`; BackendError (retryable) if none."""
        prefill = pick_prefill(await self.pool.list("prefill", lost),
                               lora=lora.name if lora is not None else None,
                               in_flight=self.pool.in_flight(), rng=self.pool.rng)
        if prefill is None:
            raise BackendError("no prefill worker is available", retryable=True)
        return prefill

    def _count_move(self, request_id: str, exc: WorkerLost, lost: set[str]) -> None:
        """Record a lost worker, or re-raise when the request has moved too often."""
        if len(lost) >= self.max_migrations:
            raise BackendError(f"{exc} (after {len(lost)} worker failures)",
                               retryable=True) from exc
        lost.add(exc.worker.address)
        role = exc.worker.role
        logger.warning("[%s] %s worker %s lost (%s): moving the request", request_id, role,
                       exc.worker.address, exc)
        if self.metrics is not None:
            counter = (self.metrics.decode_migrations if role == "decode"
                       else self.metrics.prefill_retries)
            counter.inc()

    async def _prefill(
        self, prefill: WorkerInfo, request_id: str, prompt: list[int],
        params: Any, prior: list[int], decode_address: str, decode_cached: int = 0,
        lora: common_pb2.LoRAAdapter | None = None,
        grant: common_pb2.KVTargetGrant | None = None, pending: bool = False,
        clock: _FirstTokenClock | None = None,
    ) -> TokenDelta:
        request = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                             params=params, decode_address=decode_address,
                                             prior_output_token_ids=prior,
                                             decode_cached_blocks=decode_cached, lora=lora,
                                             decode_kv_target=grant,
                                             decode_reservation_pending=pending)
        async with self.pool.channel(prefill.address) as channel:
            try:
                sent = time.monotonic()
                r = await self.prefill_calls.prefill(channel, request, self.timeout_s)
                if clock is not None:
                    clock.call = (sent, time.monotonic())
            except grpc.aio.AioRpcError as exc:
                raise await self._error(exc, prefill) from exc
        logprobs = [logprobs_from_pb(r.first_logprobs)] if r.HasField("first_logprobs") else None
        reason = r.finish_reason or None
        eos = (await self.model_info()).eos_token_ids
        stop = first_token_stop_reason(r.first_token_id, reason, params, eos)
        if prior:  # a migration: the first prefill reported the prompt's logprobs and hits
            return TokenDelta([r.first_token_id], logprobs, reason, stop)
        prompt_logprobs = None
        if params.HasField("prompt_logprobs"):
            prompt_logprobs = prompt_logprobs_from_pb(r.prompt_logprobs)
        return TokenDelta([r.first_token_id], logprobs, reason, stop,
                          prompt_logprobs=prompt_logprobs, num_cached_tokens=r.num_cached_tokens)

    async def _decode_stream(
        self, call: Any, decode: WorkerInfo, notes: _Notes, local: bool, hits: bool = True,
    ) -> AsyncIterator[TokenDelta]:
        """The decode worker's deltas (its first noted as the request's `decoding` phase); with
        `hits`, the prefix-cache hits of a prompt it prefilled itself (not those of a
        migration's re-prefill)."""
        first = True
        while True:
            msg = await self._read(call, decode)
            if msg is None:
                raise BackendError(f"decode worker {decode.address} ended the stream early")
            if first and (msg.token_ids or local):
                first = False
                notes.add("decoding")
            if not msg.token_ids and not msg.finish_reason:
                continue
            logprobs = [logprobs_from_pb(lp) for lp in msg.logprobs] or None
            stop = msg.stop_token_id if msg.HasField("stop_token_id") else None
            cached = msg.num_cached_tokens if hits and msg.HasField("num_cached_tokens") else None
            yield TokenDelta(list(msg.token_ids), logprobs, msg.finish_reason or None, stop,
                             num_cached_tokens=cached)
            if msg.finish_reason:
                return

    async def _read(self, call: Any, worker: WorkerInfo) -> Any:
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise await self._error(exc, worker) from exc
        return None if msg is grpc.aio.EOF else msg

    async def _abort(self, worker: WorkerInfo, request_id: str) -> None:
        async with self.pool.channel(worker.address) as channel:
            try:
                await prefill_pb2_grpc.PrefillStub(channel).Abort(
                    common_pb2.AbortRequest(request_id=request_id), timeout=5)
            except grpc.aio.AioRpcError as exc:
                logger.warning("[%s] abort on %s failed: %s", request_id, worker.address,
                               exc.details())

    async def _cancel(self, request_id: str) -> None:
        """Record the cancellation in Redis too: its flag and message reach every worker, also
        one whose call was still on its way."""
        if self.store is None:
            return
        try:
            await self.store.cancel(request_id)
        except Exception as exc:  # noqa: BLE001 - best effort, the gRPC cancel already went
            logger.warning("[%s] cancellation not recorded: %s", request_id, exc)

    async def _error(self, exc: grpc.aio.AioRpcError, worker: WorkerInfo) -> BackendError:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the engine's ValueError: the
            return RequestRejected(exc.details() or "invalid request")  # client's to fix
        message = f"{worker.role} worker {worker.address}: {exc.details()}"
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # dead or unreachable: a fresh channel
            await self.pool.retire(worker.address)     # next time, and the request moves
            return WorkerLost(message, worker)
        return BackendError(message, retryable=exc.code() in RETRYABLE)

    async def _transition(self, request_id: str, status: str, **fields: Any) -> None:
        """Record a phase in the request's state; only the sequence that speaks for the request
        does (`state_request_id`), the other sequences of a fan-out stay silent."""
        state_id = state_request_id(request_id)
        if self.store is None or state_id is None:
            return
        try:
            await self.store.transition(state_id, status, **fields)
        except Exception as exc:  # noqa: BLE001 - state tracking must not fail a generation
            logger.warning("[%s] state %s not recorded: %s", request_id, status, exc)


class _FirstTokenClock:
    """Where one attempt's way to its first token went, logged with it (INFO; read by
    `python -m pdserve.bench.ttft_breakdown`): routing (the registry's and the prefix index's
    Redis reads), the decode worker's reservation (Generate's first message), the Prefill call
    (the prefill worker's own part is on its "prefilled" line, with its start: the call's
    sent and answered times, on the host's monotonic clock, split the call's way there and
    back)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.routed = self.reserved = self.start
        self.beside = False  # the Prefill call went out at `routed`, beside the reservation
        self.call = (self.start, self.start)  # the (last) Prefill call: sent, answered

    def log(self, request_id: str) -> None:
        now = time.monotonic()
        sent = self.routed if self.beside else self.reserved
        logger.info("[%s] first token in %.1f ms: route %.1f, reserve %.1f%s, prefill %.1f "
                    "(call at %.4f-%.4f)", request_id, 1e3 * (now - self.start),
                    1e3 * (self.routed - self.start), 1e3 * (self.reserved - self.routed),
                    " beside" if self.beside else "", 1e3 * (now - sent), *self.call)


class _Notes:
    """One attempt's phase records, each written after the one before without the stream
    waiting for them (two Redis round trips less between a request's first and second token);
    `landed()` waits for the last, so the request's end is recorded after them."""

    def __init__(self, write: Callable[..., Awaitable[None]], request_id: str) -> None:
        self._write, self._request_id = write, request_id
        self._last: asyncio.Future[None] | None = None

    def add(self, status: str, **fields: Any) -> None:
        self._last = asyncio.ensure_future(self._after(self._last, status, fields))

    async def _after(self, before: asyncio.Future[None] | None, status: str,
                     fields: dict[str, Any]) -> None:
        if before is not None:
            await asyncio.wait({before})
        await self._write(self._request_id, status, **fields)  # never raises: logged

    async def landed(self) -> None:
        if self._last is not None:
            await asyncio.wait({self._last})  # a cancelled caller leaves it to land alone


def _beside_possible(prefill: WorkerInfo | None, decode: WorkerInfo, num_tokens: int) -> bool:
    """Whether a new request's Prefill may go out beside its reservation: the prefill worker
    understands it (one of an earlier version would push before the blocks are reserved) and
    the decode worker has room (`_room_for`)."""
    return (prefill is not None and PREFILL_BESIDE_RESERVATION in prefill.features
            and _room_for(decode, num_tokens))


def _room_for(decode: WorkerInfo, num_tokens: int) -> bool:
    """Whether the decode worker had the blocks of a `num_tokens` prompt free at its last
    heartbeat: its reservation then comes at once, and the prefill may go out beside it.
    Otherwise the reservation may queue for blocks (up to its --kv-wait-seconds), while a
    prefill sent beside it would hold the prefill worker's blocks that long (past their KV
    lease, maybe): it goes after the reservation then, as a migration's does."""
    if decode.block_size <= 0:  # its entry does not say (a worker of an earlier version)
        return False
    return decode.num_free_blocks >= -(-num_tokens // decode.block_size)


def _reservation(reserved: Any) -> tuple[int, common_pb2.KVTargetGrant | None]:
    """What a Generate's first message says for the push: the leading blocks the decode worker
    holds, and its grant of the reserved blocks to a data-plane push (if any)."""
    if reserved is None:
        return 0, None
    return reserved.cached_blocks, (reserved.kv_target if reserved.HasField("kv_target")
                                    else None)


def first_token_stop_reason(
    token_id: int, finish_reason: str | None, params: common_pb2.SamplingParams,
    eos_token_ids: Collection[int],
) -> int | None:
    """The stop reason of a request the prefill worker ended at its first token. Its response
    says only "stop", not why: the engine's own rule (`check_token_stop`) tells again. eos gives
    None (vLLM's), a stop token id gives the id; neither (a grammar completed) gives None."""
    if finish_reason != "stop":
        return None
    _, stop = check_token_stop(token_id, 1, 1, 0, eos_token_ids, params.stop_token_ids,
                               params.ignore_eos)
    return stop
