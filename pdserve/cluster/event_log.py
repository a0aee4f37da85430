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

from pdserve.cluster.state import DEFAULT_PREFIX, Keys, StateStoreError, wrap_redis_errors

MAX_BATCH = 512  # streams in one script call

# Several streams' appends in one call. KEYS: owner, events, stream hash of each stream, in
# turn. ARGV[1]: ttl s; ARGV[2]: lease ms; then per stream: owner token, end ("" (go on:
# renew the lease) | "done" (mark done, drop the lease) | "release" (drop the lease)), n, and n
# entry id, data, out triples. Returns 1 per stream written, 0 per stream (nothing written)
# whose caller does not hold the lease.
_APPEND_LUA = """
local written = {}
local a = 3
for k = 1, #KEYS, 3 do
  local owner, ending, n = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  a = a + 3
  if redis.call('GET', KEYS[k]) == owner then
    for i = a, a + 3 * n - 1, 3 do
      redis.call('XADD', KEYS[k + 1], ARGV[i], 'data', ARGV[i + 1], 'out', ARGV[i + 2])
    end
    if ending == 'done' then redis.call('HSET', KEYS[k + 2], 'done', '1') end
    if ending == '' then
      redis.call('PEXPIRE', KEYS[k], ARGV[2])
    else
      redis.call('DEL', KEYS[k])
    end
    redis.call('EXPIRE', KEYS[k + 1], ARGV[1])
    redis.call('EXPIRE', KEYS[k + 2], ARGV[1])
    written[#written + 1] = 1
  else
    written[#written + 1] = 0
  end
  a = a + 3 * n
end
return written
"""

# KEYS[1]: owner. ARGV[1]: owner token.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class LogEvent:
    """SSE event `id` of a stream: its text as sent (without the `id:` line) and what the
    gateway needs to go on after it (`out`, opaque here)."""

    id: int
    data: str
    out: str = ""


@dataclass(frozen=True)
class StreamMeta:
    spec: str  # opaque JSON, written when the stream opened
    done: bool  # the last event is in


class EventLog:
    """Resumable streams' events, specs and owner leases. Safe to share between coroutines.
    Raises ``StateStoreError`` when Redis fails."""

    def __init__(self, client: Redis, prefix: str = DEFAULT_PREFIX, ttl_s: int = 300,
                 lease_ms: int = 3000) -> None:
        if ttl_s <= 0 or lease_ms <= 0:
            raise ValueError(f"ttl_s and lease_ms must be > 0, got {ttl_s}, {lease_ms}")
        self.client = client
        self.keys = Keys(prefix)
        self.ttl_s = int(ttl_s)  # how long a log outlives its last write
        self.lease_ms = int(lease_ms)  # how long an owner that stops renewing keeps a stream
        self._append = client.register_script(_APPEND_LUA)
        self._pending: list[tuple] = []  # appends waiting for the next call (`append`)
        self._flusher: asyncio.Task[None] | None = None
        self._release = client.register_script(_RELEASE_LUA)

    @wrap_redis_errors
    async def open(self, request_id: str, owner: str, spec: str) -> None:
        """Start a log: store `spec`, make `owner` the lease holder (replacing any)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.stream(request_id), "spec", spec)
            pipe.expire(self.keys.stream(request_id), self.ttl_s)
            pipe.set(self.keys.owner(request_id), owner, px=self.lease_ms)
            await pipe.execute()

    async def append(self, request_id: str, owner: str, events: list[LogEvent],
                     end: str = "") -> bool:
        """Add `events` (ids following the log's last) and refresh the TTLs, in one script; `end`
        "" renews the lease, "done" marks the log done and drops it, "release" only drops it.
        False (nothing written) when `owner` does not hold the lease.

        NOTE: group commit. A gateway's streams each append every decode step; one script call
        each was most of a busy gateway's Redis work (docs/loadtest.md, 2026-12-05). Appends
        made while one call is in flight wait and go together in the next: one round trip
        for every stream with something new, whatever their number."""
        if end not in ("", "done", "release"):
            raise ValueError(f"end must be '', 'done' or 'release', got {end!r}")
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((request_id, owner, events, end, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await done

    async def _flush(self) -> None:
        """Send what is pending, one call at a time, until nothing is."""
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            try:
                written = await self._append_many(batch)
            except StateStoreError as exc:
                _fail(batch, exc)
                continue
            except BaseException as exc:  # cancelled (the loop ends) or a bug: nobody hangs
                _fail(batch + self._pending, StateStoreError(f"stream log writer: {exc!r}"))
                self._pending = []
                raise
            for (*_, done), ok in zip(batch, written, strict=True):
                if not done.done():  # its caller may have been cancelled meanwhile
                    done.set_result(bool(ok))

    @wrap_redis_errors
    async def _append_many(self, batch: list[tuple]) -> list[int]:
        keys: list[str] = []
        args: list[str | int] = [self.ttl_s, self.lease_ms]
        for request_id, owner, events, end, _ in batch:
            keys += [self.keys.owner(request_id), self.keys.events(request_id),
                     self.keys.stream(request_id)]
            args += [owner, end, len(events)]
            for e in events:
                args += [f"0-{e.id + 1}", e.data, e.out]
        return list(await self._append(keys=keys, args=args))

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


def _fail(batch: list[tuple], exc: BaseException) -> None:
    for *_, done in batch:
        if not done.done():
            done.set_exception(exc)
