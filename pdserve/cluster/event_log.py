"""The event log of resumable streams in Redis: what a gateway sent, so that another one (or the
same, later) can replay it and go on where it broke. Keys come from ``state.Keys``.

NOTE: one stream's keys, and who may write them.

    {p}:stream:{id}   hash     spec (opaque JSON: how to go on), done ("1" once [DONE] is in)
    {p}:events:{id}   stream   entry 0-{n+1} is SSE event n: data (the event's text), out (opaque)
    {p}:owner:{id}    string   the token of the gateway generating it, a lease of lease_ms

Only the lease holder appends (a Lua script checks the token, so a gateway that lost its lease
writes nothing), and event n always has entry id ``0-{n+1}``: a log never holds an event twice.
Every write refreshes the TTL of the hash and the stream; the final one marks the log done (or
just gives the lease up, for another gateway to take) in the same script.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from redis.asyncio import Redis

from pdserve.cluster.log_writer import LogEvent, LogWriter
from pdserve.cluster.state import DEFAULT_PREFIX, Keys, wrap_redis_errors

__all__ = ["EventLog", "LogEvent", "StreamMeta"]

# KEYS[1]: owner. ARGV[1]: owner token.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class StreamMeta:
    spec: str  # opaque JSON, written when the stream opened
    done: bool  # the last event is in


class EventLog:
    """Resumable streams' events, specs and owner leases. Safe to share between coroutines.
    Raises ``StateStoreError`` when Redis fails."""

    def __init__(self, client: Redis, prefix: str = DEFAULT_PREFIX, ttl_s: int = 300,
                 lease_ms: int = 3000, write_interval_s: float = 0.0) -> None:
        if ttl_s <= 0 or lease_ms <= 0:
            raise ValueError(f"ttl_s and lease_ms must be > 0, got {ttl_s}, {lease_ms}")
        if not 0 <= write_interval_s < lease_ms / 3000:
            raise ValueError(f"write_interval_s must be >= 0 and under a third of the lease "
                             f"({lease_ms / 3000} s), got {write_interval_s}")
        self.client = client
        self.keys = Keys(prefix)
        self.ttl_s = int(ttl_s)  # how long a log outlives its last write
        self.lease_ms = int(lease_ms)  # how long an owner that stops renewing keeps a stream
        # a gateway's writes: one script call per round trip, write_interval_s apart at least
        self.writer = LogWriter(client, self.keys, self.ttl_s, self.lease_ms, write_interval_s)
        self._release = client.register_script(_RELEASE_LUA)

    def submit(self, request_id: str, owner: str, events: list[LogEvent], end: str = "",
               spec: str = "", urgent: bool = False) -> asyncio.Future[bool]:
        """Queue `events` (ids following the log's last) for this loop's next write, without
        waiting (log_writer.py: one script call per round trip for every stream); with `spec`,
        the write opens the log: stores `spec` and makes `owner` the lease holder (replacing
        any). `end` "" keeps the lease (renewed while the stream is quiet), "done" marks the
        log done and drops it, "release" only drops it. The future: False (nothing written)
        when `owner` does not hold the lease; StateStoreError when Redis fails. `urgent`: the
        caller waits for this write (it goes without the writer's interval)."""
        return self.writer.submit(request_id, owner, events, end, spec, urgent)

    async def append(self, request_id: str, owner: str, events: list[LogEvent],
                     end: str = "", spec: str = "") -> bool:
        """`submit`, waiting for the write."""
        return await self.submit(request_id, owner, events, end, spec)

    @wrap_redis_errors
    async def acquire(self, request_id: str, owner: str) -> bool:
        """Take the lease if nobody holds it (SET NX); whether `owner` got it."""
        key = self.keys.owner(request_id)
        return bool(await self.client.set(key, owner, nx=True, px=self.lease_ms))

    @wrap_redis_errors
    async def release(self, request_id: str, owner: str) -> None:
        """Drop the lease if `owner` holds it."""
        await self._release(keys=[self.keys.owner(request_id)], args=[owner])

    @wrap_redis_errors
    async def meta(self, request_id: str) -> StreamMeta | None:
        """The stream's spec and whether it is done; None when unknown or expired. Read only."""
        fields = await self.client.hgetall(self.keys.stream(request_id))
        if "spec" not in fields:
            return None
        return StreamMeta(fields["spec"], fields.get("done") == "1")

    @wrap_redis_errors
    async def read(self, request_id: str, after: int = -1,
                   block_ms: int | None = None) -> list[LogEvent]:
        """Events after event `after` (-1: all), in order. With `block_ms`, waits that long for
        one when there is none yet (keep it under the client's socket timeout). Read only."""
        key = self.keys.events(request_id)
        reply = await self.client.xread({key: f"0-{after + 1}"}, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else reply[key][0]
        return [LogEvent(int(entry_id.split("-")[1]) - 1, f["data"], f.get("out", ""))
                for entry_id, f in entries]

