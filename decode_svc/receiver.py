"""Receiving prefilled KV into reserved blocks, one request at a time.

NOTE: a request's life on the receiving side:

    Generate opens ─▶ expect(): Pending registered, blocks reserved (WAITING_FOR_KV) — after
                     waiting for them, first come first served, while the cache is full
    PushKV header  ─▶ layout and request checked before any byte is accepted (the prefill
                     worker sends it when it admits the request, before computing anything)
    PushKV slabs   ─▶ in any order, while the prefill worker computes: written straight into
                     the reserved blocks as they arrive (KVSlabWriter checks each)
    PushKV commit  ─▶ every layer x block present exactly once, and the stream ends there?
                     commit: the request joins the decode batch behind its first token
    push cut off   ─▶ the sender went away before its commit (cancelled, or its stream ended):
                     the blocks stay reserved for another push (the gateway retries a lost
                     prefill on another worker, which pushes into the same reservation)
    a newer push   ─▶ takes over at once, even while the older one still looks alive (its
                     sender died but the connection has not said so yet): the older push
                     writes nothing more and ends cut off at its next chunk. Only a push
                     already committing refuses a newer one.
    bad bytes      ─▶ the request is aborted: its reserved blocks are freed, Generate fails
    no progress    ─▶ after the KV timeout without a header or slab (also after a cut push
                     nobody replaces): likewise

A data-plane push (cuda_ipc, nixl; pdserve/transport/) asks KVTarget for the reserved blocks'
physical ids first (becoming the current push, as a newer PushKV does), writes into them
one-sided, and announces each slab written with KVWritten on its PushKV stream (the last one
inside the commit). Generate's first message grants the blocks to push 1 ahead (`grant`), so
the first prefill worker needs no KVTarget rpc: one round trip less before the first write.
A data-plane push on this host also rings the commit doorbell as it sends its commit
(pdserve/transport/doorbell.py): the engine thread commits the request between steps
(`ring`) and the commit chunk, when it comes, only confirms it. State a doorbell reads and
changes (the current push, committing) is changed under `_lock` on both threads.
This side cannot stop such writes, so it fences them in time instead:

    KVTarget while an older data-plane push is open ─▶ waits for it to end (up to the grace
                     period) before handing out the blocks again
    the request dropped or failed ─▶ its blocks are freed once every push stream that may
                     write them has ended (bounded by the KV timeout), plus the grace period
                     for a cancelled sender's last write in flight

Blocks are reserved before a single byte arrives, so a transfer never waits for memory. Only
wrong bytes fail a request here; a silent or vanished sender is bounded by the KV timeout, and a
request that ends at its first token is dropped by its Generate being cancelled. A request
dropped while it waits for blocks (Abort, cancellation, Generate cancelled) leaves the queue with
nothing reserved; one that waits longer than `KVWaitConfig.seconds` fails (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from decode_svc.convert import first_logprobs, layout_from_pb, slab_from_pb, written_range
from decode_svc.pool import PoolExporter
from engine import handover_trace
from engine.async_engine import AsyncLLMEngine
from engine.config import NO_KV_WAIT, KVWaitConfig
from engine.kv_transfer import KVLayout, KVSlab, KVSlabWriter, layout_of
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from pdserve.cluster.grpc_server import NotFoundError, PreconditionError
from pdserve.cluster.worker import TransferStats
from pdserve.transport.base import GRPC, PoolInfo
from pdserve.transport.doorbell import Ring
from protos import decode_pb2

logger = logging.getLogger(__name__)
ABORTED = "request aborted"


class TransferFailed(ConnectionError):
    """The request's KV transfer was rejected (its bytes were wrong)."""


class PushCut(ConnectionError):
    """A push ended before its commit: its sender stopped or went away."""


@dataclass
class Pending:
    block_ids: list[int] | None = None  # None until the blocks are reserved
    cached_blocks: int = 0  # leading reserved blocks the prefix cache held: never sent
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    pushes: int = 0  # PushKV streams begun for the request; the latest one owns the blocks
    committing: bool = False
    streaming: int = 0  # the latest data-plane push whose stream's header was read here
    rung: int = 0  # the push whose doorbell committed the request (0: none)
    one_sided: bool = False  # KVTarget handed the block ids to a data-plane writer
    writers: int = 0  # open data-plane push streams of the request
    writers_idle: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))
    # When KV last made progress (reserved, header, a slab): the push streams while the prompt
    # is computed, so the wait for the KV is bounded by idle time, not by the prefill's length.
    progress_at: float = field(default_factory=time.monotonic)
    reserved_in: float = 0.0  # seconds from `expect` to its blocks reserved (the engine's part)


class KVReceiver:
    def __init__(
        self, engine: AsyncLLMEngine, kv_wait: KVWaitConfig = NO_KV_WAIT,
        exporter: PoolExporter | None = None, write_grace_s: float = 1.0,
        fence_timeout_s: float = 30.0, kv_caches: Callable[[], list] | None = None,
        layout: KVLayout | None = None,
    ):
        """`kv_caches` and `layout`: where a grpc push's slabs are written (called at the
        first such push) and its layout, for an engine in a process of its own
        (decode_svc/core_client.py); by default the engine's own (every rank's heads, with
        tensor parallelism)."""
        self.engine = engine
        self.kv_wait = kv_wait
        if kv_caches is None:
            caches = engine.engine.runner.kv_view()
            kv_caches, layout = (lambda: caches), layout_of(caches)
        assert layout is not None
        self.kv_caches, self.layout = kv_caches, layout
        self._mapped: list | None = None  # kv_caches() once called (off the event loop)
        self.exporter = exporter or PoolExporter(engine.engine.runner.kv_pool, GRPC)
        self.write_grace_s = write_grace_s
        self.fence_timeout_s = fence_timeout_s
        self.pending: dict[str, Pending] = {}
        self.stats = TransferStats()
        self._fenced: dict[str, asyncio.Task] = {}  # frees waiting for data-plane writers
        self._lock = threading.Lock()  # the event loop's and the doorbell's (engine thread)
        self._loop = asyncio.get_running_loop()

    async def expect(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prior_output_token_ids: list[int] | None = None, lora: LoRARequest | None = None,
    ) -> bool:
        """Reserve the blocks of the prompt and of any prior output tokens, waiting for them as
        `kv_wait` allows when the cache is full. False if the request was dropped before they
        were reserved (nothing stays reserved); KVCacheFullError / ValueError if impossible
        (also: `lora`, the request's adapter, fails to load: nothing is reserved)."""
        if request_id in self.pending:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pending = self.pending[request_id] = Pending()
        started = time.monotonic()
        try:
            reservation = await self.engine.reserve_remote(
                request_id, prompt_token_ids, params, prior_output_token_ids, self.kv_wait,
                lora_request=lora)
        except BaseException:
            self.pending.pop(request_id, None)
            raise
        if reservation is None or pending.done.is_set():  # dropped while reserving
            self.pending.pop(request_id, None)
            await self.engine.abort(request_id)  # frees blocks granted just before the drop
            return False
        pending.block_ids = reservation.block_ids
        pending.cached_blocks = reservation.num_cached_blocks
        pending.progress_at = time.monotonic()
        pending.reserved_in = pending.progress_at - started
        return True

    async def wait(self, request_id: str, timeout_s: float) -> bool:
        """Until the request's KV is committed (True) or the request is aborted here (False).
        After `timeout_s` without progress (no header or slab), or on a failed transfer, the
        request is aborted (blocks freed) and TimeoutError / TransferFailed raised."""
        pending = self.pending[request_id]
        try:
            while not pending.done.is_set():
                idle = time.monotonic() - pending.progress_at
                if idle >= timeout_s:
                    raise TimeoutError(f"KV of request {request_id!r} did not arrive: nothing "
                                       f"came for {timeout_s:g} s")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(pending.done.wait(), timeout_s - idle)
        except BaseException:
            await self.drop(request_id)
            raise
        finally:
            self.pending.pop(request_id, None)
        if pending.error == ABORTED:
            return False
        if pending.error is not None:
            raise TransferFailed(pending.error)
        return True

    async def drop(self, request_id: str) -> bool:
        """Abort the request wherever it is and free its blocks (Generate cancelled, timeouts,
        Abort rpc). True if this worker knew it."""
        pending = self.pending.pop(request_id, None)
        if pending is not None and not pending.done.is_set():
            pending.error = ABORTED
            pending.done.set()
        return await self._free(request_id, pending)

    def cached_blocks(self, request_id: str) -> int:
        """Leading reserved blocks of an expected request that this worker's prefix cache
        holds already: its push sends only the blocks after them."""
        return self.pending[request_id].cached_blocks

    def grant(self, request_id: str) -> tuple[str, list[int], int] | None:
        """Grant an expected request's reserved blocks to its first data-plane push ahead of
        it, as `target` would: (pool id, physical block ids, push id), or None while this
        worker exports no data plane. The push then needs no KVTarget rpc; from here the
        request's blocks are fenced like a target's (see `_free`), and a later KVTarget or
        grpc push supersedes the grant."""
        if not any(self.exporter.accepts(t) for t in self.exporter.offered if t != GRPC):
            return None
        with self._lock:
            pending = self._waiting_for_kv(request_id)
            assert pending.block_ids is not None
            pending.pushes += 1
            pending.one_sided = True
            return self.exporter.pool_id, list(pending.block_ids), pending.pushes

    def describe(self, wanted: list[str]) -> PoolInfo:
        """This worker's pool for a prefill worker that could use `wanted` data planes."""
        return self.exporter.describe(wanted)

    async def target(self, request_id: str, pool_id: str, transport: str) -> tuple[list[int], int]:
        """Hand a data-plane push the request's reserved blocks: (physical block ids, push id).
        The caller becomes the request's current push. PreconditionError for a pool of an
        earlier process, ValueError for a transport not offered, NotFoundError as `receive`."""
        if pool_id != self.exporter.pool_id:
            raise PreconditionError(f"KV pool {pool_id!r} is stale: this worker's pool is "
                                    f"{self.exporter.pool_id!r} (it restarted)")
        if not self.exporter.accepts(transport):
            raise ValueError(f"KV transport {transport!r} is not offered here "
                             f"(offered: {', '.join(self.exporter.offered)})")
        pending = self._waiting_for_kv(request_id)
        if pending.writers:  # an older writer may still be writing: let it finish first
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(pending.writers_idle.wait(), self.write_grace_s)
        with self._lock:
            pending = self._waiting_for_kv(request_id)
            assert pending.block_ids is not None
            pending.pushes += 1
            pending.one_sided = True
            pending.progress_at = time.monotonic()
            return list(pending.block_ids), pending.pushes

    def ring(self, ring: Ring) -> None:
        """A commit doorbell's record, on the engine thread (`AsyncLLMEngine.between_steps`),
        or on the doorbell's waker thread when the engine runs in a process of its own (its
        `commit_here` sends the commit there): commit the request now if the ringing push is
        its current one, its stream is open here (the header read: that stream then ends in
        the commit or is cut) and nothing ended the request; else ignore the record (the
        push's commit chunk, or its absence, decides as without a doorbell). The request's
        Generate is woken on the event loop."""
        with self._lock:
            pending = self.pending.get(ring.request_id)
            if (pending is None or pending.block_ids is None or pending.done.is_set()
                    or pending.committing or pending.pushes != ring.push_id
                    or pending.streaming != ring.push_id):  # else its stream commits
                return
            pending.committing = True
            pending.rung = ring.push_id
        handover_trace.mark(ring.request_id, "commit_in")
        self.engine.commit_here(ring.request_id, ring.first_token_id, None)
        self.stats.doorbell_commits += 1
        self._loop.call_soon_threadsafe(pending.done.set)

    def _waiting_for_kv(self, request_id: str) -> Pending:
        """The request's Pending if a push may still write its KV; NotFoundError if not."""
        pending = self.pending.get(request_id)
        if pending is None or pending.block_ids is None or pending.done.is_set():
            raise NotFoundError(f"no open Generate waiting for KV of request {request_id!r}")
        if pending.committing:
            raise NotFoundError(f"the KV of request {request_id!r} is being committed")
        return pending

    async def _free(self, request_id: str, pending: Pending | None) -> bool:
        """Abort the request in the engine (freeing its blocks): at once, or, when a data
        plane may still write into them, once its pushes ended plus the grace period."""
        if request_id in self._fenced:  # dropped again (Generate's own cleanup): no sooner
            return True
        if pending is None or not pending.one_sided:
            return await self.engine.abort(request_id)
        self._fenced[request_id] = asyncio.create_task(
            self._free_after_writers(request_id, pending))
        return True

    async def _free_after_writers(self, request_id: str, pending: Pending) -> None:
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(pending.writers_idle.wait(), self.fence_timeout_s)
            await asyncio.sleep(self.write_grace_s)
            await self.engine.abort(request_id)
            logger.info("[%s] blocks freed after the data-plane writers stopped", request_id)
        finally:
            del self._fenced[request_id]

    async def receive(self, chunks: AsyncIterator[decode_pb2.KVChunk | KVSlab]) -> int:
        """Consume one PushKV stream (its KVData chunks parsed already or as KVSlab, viewed in
        place: convert.chunk_from_wire); returns the bytes accepted. A push cut off before its
        commit, or superseded by a newer push of the request, leaves the request to the next
        push; any other error fails the request (its blocks freed, its Generate told). Errors
        propagate to the sender."""
        header = await _first_header(chunks)
        request_id = header.request_id
        transport = header.transport or GRPC
        if transport == GRPC:
            with self._lock:
                pending = self._waiting_for_kv(request_id)
                pending.pushes += 1
                push = pending.pushes
        else:  # the push KVTarget named
            pending = self._waiting_for_kv(request_id)
            if not self.exporter.accepts(transport):
                raise ValueError(f"KV transport {transport!r} is not offered here")
            with self._lock:
                if header.push_id != pending.pushes:
                    raise PushCut("a newer push of the request took over its blocks")
                push = pending.streaming = header.push_id
            pending.writers += 1
            pending.writers_idle.clear()
        started = time.perf_counter()
        try:
            received, commit, first_slab_at = await self._write_all(
                header, pending, push, chunks, transport)
            with self._lock:
                rung = pending.rung == push  # the doorbell committed it already
                pending.committing = True  # from here the engine may hold the request
            if not rung:
                handover_trace.mark(request_id, "commit_in")
                await self.engine.commit_remote(request_id, commit.first_token_id,
                                                first_logprobs(commit))
        except BaseException as exc:
            with self._lock:  # a ring of this push arriving from here is ignored
                rung = pending.rung == push
                if pending.streaming == push and not rung:
                    pending.streaming = 0
            superseded = pending.pushes != push  # whatever it did wrong, it owns nothing now
            cut = isinstance(exc, (asyncio.CancelledError, PushCut)) and not pending.committing
            if rung and isinstance(exc, (asyncio.CancelledError, PushCut)):
                # its doorbell committed the request (every block written): nothing is lost
                logger.info("[%s] KV push ended after its doorbell: %s", request_id,
                            _reason(exc))
                raise
            if not (superseded or cut):
                await self._fail(request_id, pending, exc)
                raise
            self.stats.cut += 1
            if not superseded and not pending.done.is_set():
                pending.progress_at = time.monotonic()  # still wanted: wait for another push
            logger.info("[%s] KV push cut off: %s; the blocks stay reserved", request_id,
                        _reason(exc))
            raise
        finally:
            if transport != GRPC:
                pending.writers -= 1
                if not pending.writers:
                    pending.writers_idle.set()
        now = time.perf_counter()
        seconds = now - started
        self.stats.record(received, seconds, transport)
        self.stats.skipped_blocks += header.skip_blocks
        self.stats.first_slab_to_commit_seconds += now - first_slab_at
        logger.info("[%s] KV received: %d bytes in %.1f ms (reserved in %.1f ms)", request_id,
                    received, seconds * 1e3, pending.reserved_in * 1e3)
        pending.done.set()
        return received

    async def _fail(self, request_id: str, pending: Pending, exc: BaseException) -> None:
        """The transfer failed: free the blocks; the request's Generate raises TransferFailed."""
        self.stats.failed += 1
        pending.error = f"KV transfer failed: {_reason(exc)}"
        pending.done.set()
        await self._free(request_id, pending)

    async def _write_all(
        self, header: decode_pb2.KVHeader, pending: Pending, push: int,
        chunks: AsyncIterator[decode_pb2.KVChunk | KVSlab], transport: str,
    ) -> tuple[int, decode_pb2.KVCommit, float]:
        """Write the slabs up to the commit chunk, which must come last, once every layer x block
        has arrived: (bytes written, the commit, when the first slab came). Each chunk is checked
        against the request's state before it is written: a push superseded by a newer one, or a
        request dropped meanwhile, writes nothing more."""
        self.layout.check_compatible(layout_from_pb(header.layout))
        assert pending.block_ids is not None  # `receive` checked it
        if header.num_blocks != len(pending.block_ids):
            raise ValueError(
                f"header announces {header.num_blocks} blocks, {len(pending.block_ids)} reserved"
            )
        if header.skip_blocks != pending.cached_blocks:  # never a write into shared blocks
            raise ValueError(f"header skips {header.skip_blocks} blocks, this worker holds "
                             f"the first {pending.cached_blocks} (Generate's cached_blocks)")
        if transport == GRPC and self._mapped is None:  # a GPU pool is opened by its handle
            self._mapped = await asyncio.to_thread(self.kv_caches)  # (a CUDA context: ~1 s)
        writer = KVSlabWriter(self._mapped if transport == GRPC else None, pending.block_ids,
                              present=header.skip_blocks, layout=self.layout)
        pending.progress_at = time.monotonic()
        first_slab_at = None
        async for chunk in chunks:
            kind = "data" if isinstance(chunk, KVSlab) else chunk.WhichOneof("chunk")
            if kind == "commit":
                if chunk.commit.HasField("written"):  # a data plane's last slab, announced
                    if transport == GRPC:
                        raise ValueError("a grpc push's commit carries no written range")
                    _check_current(header.request_id, pending, push)
                    writer.mark_written(written_range(chunk.commit.written))
                    first_slab_at = first_slab_at or time.perf_counter()
                if not writer.complete:
                    raise ValueError("KV commit before every layer and block arrived")
                async for _ in chunks:
                    raise ValueError("a KV stream ends with its commit")
                _check_current(header.request_id, pending, push)
                return writer.bytes_received, chunk.commit, first_slab_at or time.perf_counter()
            if kind != ("data" if transport == GRPC else "written"):
                what = "data" if transport == GRPC else f"{transport} written"
                raise ValueError(f"a KV stream carries one header, then {what} chunks and a "
                                 "commit")
            _check_current(header.request_id, pending, push)
            if isinstance(chunk, KVSlab):
                writer.write(chunk)
            elif kind == "data":
                writer.write(slab_from_pb(chunk.data))
            else:
                writer.mark_written(written_range(chunk.written))
            pending.progress_at = time.monotonic()
            first_slab_at = first_slab_at or time.perf_counter()
        if not writer.complete:
            raise PushCut("KV stream ended before every layer and block arrived")
        raise PushCut("KV stream ended without its commit")


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):  # the sender cancelled (or was cut off)
        return "the push was cancelled"
    return str(exc) or type(exc).__name__


def _check_current(request_id: str, pending: Pending, push: int) -> None:
    """PushCut once a newer push of the request took over its blocks; NotFoundError once `drop`
    ended the request mid-transfer (timeout, cancelled Generate, Abort): its blocks are freed,
    maybe another request's already. A push whose doorbell committed the request is current."""
    if pending.pushes != push:
        raise PushCut("a newer push of the request took over its blocks")
    if pending.done.is_set() and pending.rung != push:
        raise NotFoundError(
            f"request {request_id!r} was dropped while its KV arrived: {pending.error}"
        )


async def _first_header(
    chunks: AsyncIterator[decode_pb2.KVChunk | KVSlab],
) -> decode_pb2.KVHeader:
    async for chunk in chunks:
        if isinstance(chunk, KVSlab) or not chunk.HasField("header"):
            raise ValueError("a KV stream must start with a KVHeader")
        return chunk.header
    raise ValueError("empty KV stream")
