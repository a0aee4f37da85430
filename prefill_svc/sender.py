"""Shipping a request's KV blocks to a decode worker while the prefill worker computes them.

`PushKVSender` streams PushKV from the moment the request is admitted:

    header (layout, request, tokens, blocks)         at once
    slab, slab, ...                                  as `KVPush.next_slab` hands them out: layer
                                                     groups and blocks the engine noted final
    commit (first token, its logprobs)               once the first token is sampled and every
                                                     layer x block has gone; over a data plane
                                                     also rung on the peer's doorbell when it is
                                                     on this host (`_ring`)

The slabs' bytes travel in the stream (grpc) or over the data plane chosen for the decode
worker (`prefill_svc/planes.py`: cuda_ipc, nixl): then the decode worker's grant (passed on by
the gateway from its Generate) or else a KVTarget rpc gives the reserved blocks' physical ids,
each slab is written straight into them (off the event loop, inside `SlabTicket.reading()`;
the writes that pushes to one decode worker ask for together go as one:
`prefill_svc/write_batches.py`), and only its range goes in the stream (KVWritten; the last
one inside the commit). Those pushes share one PushKVStreams call per decode worker
(prefill_svc/push_streams.py) unless the worker runs with `--kv-push-streams per-request`. A
pool refused as stale (the decode worker restarted) sends that push over grpc and the peer is
described again next time.

Each slab is gathered off the event loop (a sender thread: torch releases the GIL inside its
ops, so the gather runs while the engine computes later layers) while the previous one is on
the wire.

The grpc path's slabs become wire bytes in `prefill_svc/slab_stager.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import grpc
import torch

from decode_svc.convert import layout_to_pb
from engine.kv_transfer import layout_of
from pdserve.cluster.convert import logprobs_to_pb
from pdserve.cluster.grpc_server import open_channel
from pdserve.cluster.tls import PLAINTEXT, TLSConfig
from pdserve.cluster.worker import TransferStats
from pdserve.transport.base import GRPC, DataPlane, Peer, host_id
from pdserve.transport.doorbell import DoorbellSender, Ring
from prefill_svc.planes import PeerPlanes
from prefill_svc.push import KVPush
from prefill_svc.push_streams import PushFailed, PushStreamsCall, StreamsFailed, decode_rpc_path
from prefill_svc.slab_stager import SlabStager, cells
from prefill_svc.write_batches import WriteBatches
from protos import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)
# A data-plane write costs a few tenths of a millisecond however small (a thread hop, the block
# ids to the device, a launch, a synchronisation, a KVWritten message; measured on an H100), so
# its slabs are as large as what is final allows: a layer group of a step, or all of a computed
# KV (1 GiB: 32k tokens of a 1B-shaped model, 8k of an 8B one, in one write).
PLANE_SLAB_BYTES = 1 << 30

PUSH_KV = decode_rpc_path("PushKV")


class KVSender(Protocol):
    stats: TransferStats

    async def send(self, decode_address: str, push: KVPush) -> int:
        """Ship `push` to the decode worker as its KV becomes final; returns bytes accepted.
        Raises on failure (the caller frees the blocks either way)."""
        ...

    def whole_steps(self, decode_address: str, num_tokens: int) -> bool:
        """True when a push of `num_tokens` to the decode worker sends only at a step's end,
        so the engine need not note its KV layer group by layer group."""
        ...

    async def close(self) -> None:
        ...


class PushKVSender:
    def __init__(
        self, kv_caches: list[torch.Tensor], slab_bytes: int = 2 << 20, timeout_s: float = 60.0,
        tls: TLSConfig = PLAINTEXT, planes: PeerPlanes | None = None,
        plane_slab_bytes: int = PLANE_SLAB_BYTES, shared_streams: bool = True,
    ):
        """`shared_streams`: data-plane pushes to a decode worker share one PushKVStreams
        call (prefill_svc/push_streams.py); False: a PushKV stream each, as grpc pushes."""
        self.kv_caches = kv_caches
        self.tls = tls
        self.layout = layout_of(kv_caches)
        self.slab_bytes = slab_bytes
        self.timeout_s = timeout_s
        self.planes = planes  # None: grpc only
        self.plane_slab_bytes = plane_slab_bytes
        self.shared_streams = shared_streams
        self.stats = TransferStats()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[str, PushStreamsCall] = {}
        self._doorbell: DoorbellSender | None = None
        self._writes = WriteBatches(self.layout.cell_bytes(), self.stats)

    def new_push(self, request_id: str, num_tokens: int, skip_blocks: int = 0,
                 reserved: bool = True) -> KVPush:
        """An empty push of this worker's layout and slab size, for the engine to fill; its
        first `skip_blocks` blocks are held by the receiver already and never sent (not
        `reserved`: told by `KVPush.reserve`, which `send` waits for)."""
        return KVPush(request_id, num_tokens, self.layout, self.slab_bytes, skip_blocks,
                      reserved)

    def whole_steps(self, decode_address: str, num_tokens: int) -> bool:
        """A data plane towards the decode worker is open already and the push's KV fits one
        of its slabs: its slabs then leave only when a step ends (`KVPush.next_slab` hands a
        slab out when it is full or the step's layers are all final), and the layer groups'
        notes in between would only wake the push for nothing (on a busy prefill worker, a
        cross-thread callback per request per group)."""
        if self.planes is None or self.planes.known(decode_address) is None:
            return False
        blocks = -(-num_tokens // self.layout.block_size)
        return blocks * self.layout.num_layers * self.layout.cell_bytes() <= self.plane_slab_bytes

    async def send(self, decode_address: str, push: KVPush) -> int:
        try:  # the decode worker's reservation, told by the gateway (PrefillServicer.Reserved)
            await asyncio.wait_for(push.reservation.wait(), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no reservation of request {push.request_id!r} was told within "
                               f"{self.timeout_s:g} s") from None
        channel = self._channel(decode_address)
        started = time.perf_counter()
        peer, target = await self._data_plane(decode_address, channel, push)
        if peer is None:
            transport = GRPC
            received = await self._push_kv(decode_address, channel, self.messages(push))
        else:
            transport = peer.transport
            push.resize_slabs(self.plane_slab_bytes)
            chunks = self.written(push, peer, target, decode_address)
            if self.shares_stream(peer):
                received = await self._push_shared(decode_address, channel, push,
                                                   target.push_id, chunks)
            else:
                received = await self._push_kv(decode_address, channel, _wire(chunks))
        self.stats.record(received, time.perf_counter() - started, transport)
        self.stats.skipped_blocks += push.skip_blocks
        self.stats.record_overlap(push.bytes_before_first_token,
                                  (push.commit_sent_at or 0.0) - (push.first_token_at or 0.0))
        return received

    def shares_stream(self, peer: Peer) -> bool:
        """Whether a data-plane push to `peer` goes on the shared PushKVStreams call: when this
        worker shares them and the decode worker serves it (one of an earlier version does not:
        its pushes keep a PushKV stream each, through a rolling upgrade)."""
        return self.shared_streams and peer.info.push_streams

    async def _push_kv(self, address: str, channel: grpc.aio.Channel,
                       messages: AsyncIterator[bytes]) -> int:
        """One push on a PushKV stream of its own: the bytes accepted."""
        call = channel.stream_unary(
            PUSH_KV, response_deserializer=decode_pb2.PushKVResponse.FromString
        )  # no request serializer: `messages` yields wire bytes
        try:
            reply = await call(messages, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.stats.failed += 1
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # the peer may be gone: forget it
                await self._drop_channel(address)
                self._forget(address)
            raise ConnectionError(f"KV push to {address} failed: {exc.details()}") from exc
        return reply.bytes_received

    async def _push_shared(self, address: str, channel: grpc.aio.Channel, push: KVPush,
                           push_id: int, chunks: AsyncGenerator[decode_pb2.KVChunk, None]
                           ) -> int:
        """One data-plane push on the decode worker's shared PushKVStreams call (opened by
        the first push, again after it failed): the bytes accepted."""
        call = self._streams.get(address)
        if call is None or call.failed is not None:
            call = self._streams[address] = PushStreamsCall(channel, address)
        try:
            received = await call.push(push.request_id, push_id, chunks, self.timeout_s)
        except PushFailed as exc:
            self.stats.failed += 1
            if isinstance(exc, StreamsFailed) and exc.code == grpc.StatusCode.UNAVAILABLE:
                await self._drop_channel(address)  # the peer may be gone: forget it
                self._forget(address)
            raise ConnectionError(f"KV push to {address} failed: {exc}") from exc
        self.stats.shared_stream += 1
        return received

    async def _data_plane(
        self, address: str, channel: grpc.aio.Channel, push: KVPush
    ) -> tuple[Peer | None, Any]:
        """The data plane towards `address` and the request's target blocks there (`block_ids`,
        `push_id`): the decode worker's grant when it is for the pool mapped here, else
        KVTarget's reply; (None, None) for grpc (configured, chosen, or the fallback from a
        stale or failed peer)."""
        if self.planes is None:
            return None, None
        request_id = push.request_id
        try:
            peer = await self.planes.peer(address, channel)
        except ConnectionError as exc:
            logger.warning("[%s] KV to %s over grpc: %s", request_id, address, exc)
            return None, None
        if peer is None:
            return None, None
        grant = push.grant
        if (grant is not None and grant.pool_id == peer.info.pool_id
                and len(grant.block_ids) == push.num_blocks):
            self.stats.granted += 1
            return peer, grant  # no KVTarget round trip
        try:
            target = await decode_pb2_grpc.DecodeStub(channel).KVTarget(decode_pb2.KVTargetRequest(
                request_id=request_id, pool_id=peer.info.pool_id, transport=peer.transport,
            ), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # gone? start afresh next time
                self._forget(address)
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    await self._drop_channel(address)
                raise ConnectionError(f"KV target at {address}: {exc.details()}") from exc
            self.stats.stale_pools += 1
            logger.warning("[%s] %s; this push goes over grpc", request_id, exc.details())
            self._forget(address)
            return None, None
        return peer, target

    def _forget(self, address: str) -> None:
        if self.planes is not None:
            self.planes.forget(address)

    async def messages(self, push: KVPush) -> AsyncIterator[bytes]:
        """The push's KVChunk messages as wire bytes: the header, every slab as it becomes
        final (each gathered off the event loop), the commit. Reads the cache."""
        yield self._header(push)
        stager = SlabStager(self.kv_caches)
        while (ticket := await push.next_slab()) is not None:
            message = await asyncio.to_thread(stager.encode, ticket)
            if message is not None:  # None: stale, a preemption; those cells come again
                push.sent(ticket, cells(ticket.slab) * self.layout.cell_bytes())
                yield message
        yield self._commit(push)

    async def written(
        self, push: KVPush, peer: Peer, target: Any, address: str
    ) -> AsyncGenerator[decode_pb2.KVChunk, None]:
        """The push over a data plane: the header naming it, each slab written into the
        target blocks (off the event loop) and then announced, the commit. Reads the cache. A
        failed write forgets the peer (described again next time) and ends the push: grpc
        cancels the call, and the blocks stay reserved there for a retried prefill.

        Each write starts before the message ahead of it goes out: the first one before the
        header (the blocks are the grant's, reserved for this push, and nothing there waits for
        the header before bytes land: grpc sends it while they move; on the 2-core CPU box the
        header's send took 0.2-1.0 ms of a 3 ms push), each next one before the previous
        slab's announcement."""
        assert self.planes is not None
        plane = self.planes.plane(peer.transport)
        dst_ids = list(target.block_ids)
        writing = asyncio.ensure_future(self._write_next(push, plane, peer, dst_ids, address))
        try:
            yield self._header_chunk(push, peer.transport, target.push_id)
            last = None  # once the first token is known, each slab's range waits for the next
            # write, so the last one goes inside the commit: one message less before it
            while (written := await writing) is not False:
                writing = asyncio.ensure_future(
                    self._write_next(push, plane, peer, dst_ids, address))
                if last is not None:
                    yield decode_pb2.KVChunk(written=last)
                    last = None
                if written is not None:  # None: stale, a preemption; those cells come again
                    last = written
                    if push.first is None:  # more may take a while: announce it now
                        yield decode_pb2.KVChunk(written=last)
                        last = None
            commit = self._commit_chunk(push, last)
            self._ring(push, peer, target.push_id)
            yield commit
        finally:
            writing.cancel()  # a write under way finishes in its thread, its result unread

    async def _write_next(self, push: KVPush, plane: DataPlane, peer: Peer, dst_ids: list[int],
                          address: str) -> decode_pb2.KVWritten | None | bool:
        """Write the push's next slab into the peer's blocks (off the event loop): its range,
        None if it was stale, False once every slab is out."""
        ticket = await push.next_slab()
        if ticket is None:
            return False
        l0, l1, b0, b1 = ticket.slab
        try:
            nbytes, seconds = await self._writes.write(plane, peer, ticket, dst_ids[b0:b1])
            self.stats.write_seconds += seconds
        except ConnectionError as exc:
            self.stats.failed += 1
            self._forget(address)
            logger.warning("[%s] KV write to %s failed: %s", push.request_id, address, exc)
            raise
        if nbytes is None:
            return None
        push.sent(ticket, nbytes)
        return decode_pb2.KVWritten(layer_start=l0, layer_end=l1, block_start=b0, block_end=b1)

    def _ring(self, push: KVPush, peer: Peer, push_id: int) -> None:
        """Every slab is in the peer's blocks: ring its commit doorbell, when it has one on
        this host, so its engine commits the request without waiting for the commit chunk
        (pdserve/transport/doorbell.py). Not for a first token with logprobs (the record has
        no room for them): that commit goes in the chunk alone."""
        doorbell = peer.info.doorbell
        assert push.first is not None
        if not doorbell or push.first[1] is not None or peer.info.host_id != host_id():
            return
        if self._doorbell is None:
            self._doorbell = DoorbellSender()
        self._doorbell.ring(doorbell, Ring(push.request_id, push_id, push.first[0],
                                           peer.info.pool_id))

    def _header(self, push: KVPush) -> bytes:
        return self._header_chunk(push, GRPC, 0).SerializeToString()

    def _header_chunk(self, push: KVPush, transport: str, push_id: int) -> decode_pb2.KVChunk:
        return decode_pb2.KVChunk(header=decode_pb2.KVHeader(
            request_id=push.request_id, layout=layout_to_pb(self.layout),
            num_tokens=push.num_tokens, num_blocks=push.num_blocks, transport=transport,
            push_id=push_id, skip_blocks=push.skip_blocks,
        ))

    def _commit(self, push: KVPush) -> bytes:
        return self._commit_chunk(push).SerializeToString()

    def _commit_chunk(self, push: KVPush, written: decode_pb2.KVWritten | None = None
                      ) -> decode_pb2.KVChunk:
        assert push.first is not None
        commit = decode_pb2.KVCommit(first_token_id=push.first[0], written=written)
        if push.first[1] is not None:
            commit.first_logprobs.CopyFrom(logprobs_to_pb(push.first[1]))
        push.commit_sent_at = time.perf_counter()
        return decode_pb2.KVChunk(commit=commit)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.tls)
        return self._channels[address]

    async def _drop_channel(self, address: str) -> None:
        streams = self._streams.pop(address, None)
        if streams is not None:
            await streams.close()
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self._drop_channel(address)
        if self.planes is not None:
            self.planes.close()
        if self._doorbell is not None:
            self._doorbell.close()


async def _wire(chunks: AsyncGenerator[decode_pb2.KVChunk, None]) -> AsyncIterator[bytes]:
    """`chunks` as wire bytes; closing this closes them (a data-plane push's pending write)."""
    try:
        async for chunk in chunks:
            yield chunk.SerializeToString()
    finally:
        await chunks.aclose()

