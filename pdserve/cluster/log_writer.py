"""One gateway's writes to its streams' event logs (event_log.py): every stream's new events
in one script call per Redis round trip, and the leases of quiet streams renewed.

NOTE: why one writer. A busy gateway streams to hundreds of clients, each getting an event
every decode step. A writer task per stream (wake, call, wait) cost a gateway about as much as
rendering its SSE (docs/loadtest.md, 2026-12-05); here a stream's event costs a list append:

    submit(stream, events) ──▶ pending[stream] ──┐   (a stream's submits while a call is in
                                                 │    flight join one entry)
    the writer task: while anything is pending or held
        (interval_s after the last call's start at the earliest, unless a submitter waits
         for its write: a stream's end, an event sent only once logged)
        take every pending entry (and the held streams quiet for lease/3: empty entries)
        one script call ──▶ per stream: written, or not the lease holder's (nothing written)
        resolve each entry's future; a stream that ended or lost its lease is no longer held
        nothing pending: sleep until woken or until the oldest held stream is due

A stream's entries go in submit order, so its events land in order without its submitter
waiting for anything. A gateway that dies loses what was pending at most: the events of its
last interval_s and round trip. The interval bounds the calls: a call's client work (redis-py's
path, the socket write) costs far more than an event's share of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

from redis.asyncio import Redis

from pdserve.cluster.state import Keys, StateStoreError, wrap_redis_errors

MAX_BATCH = 512  # streams in one script call

# Several streams' writes in one call. ARGV[1]: ttl s; ARGV[2]: lease ms; ARGV[3]: JSON, per
# stream [owner key, events key, stream hash key, owner token, end, spec, entries]: end "" (go
# on: renew the lease) | "done" (mark done, drop the lease) | "release" (drop the lease); spec
# "" or a new stream's spec (stored, and the lease taken, replacing any); entries a flat list of
# entry id, data, out. One argument, not several per event: the client's encoding of each
# argument cost more than the rest of a write (Python, per argument). The key names come in
# the JSON, not KEYS: a script writing many streams cannot serve Redis Cluster anyway.
# Returns a string of a character per stream: 1 written, 0 (nothing written) its caller does
# not hold the lease (a string, not a list: the client parses a list's items one by one).
_WRITE_LUA = """
local written = {}
for _, s in ipairs(cjson.decode(ARGV[3])) do
  local owner_key, events_key, stream_key, owner, ending, spec, entries = unpack(s)
  if spec ~= '' then
    redis.call('HSET', stream_key, 'spec', spec)
    redis.call('SET', owner_key, owner, 'PX', ARGV[2])
  end
  if redis.call('GET', owner_key) == owner then
    for i = 1, #entries, 3 do
      redis.call('XADD', events_key, entries[i], 'data', entries[i + 1], 'out', entries[i + 2])
    end
    if ending == 'done' then redis.call('HSET', stream_key, 'done', '1') end
    if ending == '' then
      redis.call('PEXPIRE', owner_key, ARGV[2])
    else
      redis.call('DEL', owner_key)
    end
    redis.call('EXPIRE', events_key, ARGV[1])
    redis.call('EXPIRE', stream_key, ARGV[1])
    written[#written + 1] = '1'
  else
    written[#written + 1] = '0'
  end
end
return table.concat(written)
"""


@dataclass(frozen=True)
class LogEvent:
    """SSE event `id` of a stream: its text as sent (without the `id:` line) and what the
    gateway needs to go on after it (`out`, opaque here)."""

    id: int
    data: str
    out: str = ""


@dataclass(eq=False)
class _Entry:
    """What one stream's next call writes."""

    request_id: str
    owner: str
    done: asyncio.Future[bool]
    events: list[LogEvent] = field(default_factory=list)
    end: str = ""
    spec: str = ""


class LogWriter:
    """The writes of one event loop's streams (EventLog.submit); one task sends them."""

    def __init__(self, client: Redis, keys: Keys, ttl_s: int, lease_ms: int,
                 interval_s: float = 0.0) -> None:
        self.keys, self.ttl_s, self.lease_ms = keys, ttl_s, lease_ms
        self.renew_s = lease_ms / 3000  # a quiet stream's lease is renewed this often
        self.interval_s = interval_s  # the least time from one call's start to the next's
        self._script = client.register_script(_WRITE_LUA)
        self._pending: list[_Entry] = []  # in submit order
        self._open: dict[str, _Entry] = {}  # the pending entry a stream's submits join
        self._held: dict[str, tuple[str, float]] = {}  # streams to renew: owner, last call
        # (oldest first)
        self._wake = asyncio.Event()  # something was submitted
        self._urgent = asyncio.Event()  # a submitter waits for its write: no interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    def submit(self, request_id: str, owner: str, events: list[LogEvent], end: str = "",
               spec: str = "", urgent: bool = False) -> asyncio.Future[bool]:
        """Queue `events` (and `end`; `spec` for a new stream) for the next call; its future says
        whether they were written (False: `owner` does not hold the lease) or raises
        StateStoreError. A stream's submits before that call join one entry, up to its end.
        `urgent` (and any `end`): the submitter waits for the write, so the next call goes
        without waiting out the interval."""
        if end not in ("", "done", "release"):
            raise ValueError(f"end must be '', 'done' or 'release', got {end!r}")
        idle = self._task is None or self._task.done()
        if idle:
            self._loop = asyncio.get_running_loop()
        entry = self._open.get(request_id)
        if entry is None or entry.owner != owner:
            entry = self._queue(request_id, owner)
        entry.events += events
        entry.spec = entry.spec or spec
        if end:
            entry.end = end
            del self._open[request_id]  # nothing joins an ended stream's entry
        if end or urgent:
            self._urgent.set()
        if not self._wake.is_set():
            self._wake.set()
        if idle:
            self._task = self._loop.create_task(self._run())
        return entry.done

    def _queue(self, request_id: str, owner: str) -> _Entry:
        entry = _Entry(request_id, owner, self._loop.create_future())
        self._pending.append(entry)
        self._open[request_id] = entry
        return entry

    async def _run(self) -> None:
        """Send what is pending and renew what is held, one call at a time, until neither
        is left."""
        loop = asyncio.get_running_loop()
        batch: list[_Entry] = []
        sent_at = -self.interval_s
        try:
            while self._pending or self._held:
                if not self._pending:
                    self._wake.clear()
                    oldest = next(iter(self._held.values()))[1]
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(oldest + self.renew_s):
                            await self._wake.wait()
                if loop.time() < sent_at + self.interval_s and not self._urgent.is_set():
                    with contextlib.suppress(TimeoutError):  # gather more
                        async with asyncio.timeout_at(sent_at + self.interval_s):
                            await self._urgent.wait()
                self._urgent.clear()
                self._renew_due(loop.time())
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                for entry in batch:
                    if self._open.get(entry.request_id) is entry:
                        del self._open[entry.request_id]
                if batch:
                    sent_at = loop.time()
                    await self._send(batch, sent_at)
                batch = []
        except BaseException as exc:  # cancelled (the loop ends) or a bug: nobody hangs
            _fail(batch + self._pending, StateStoreError(f"stream log writer: {exc!r}"))
            self._pending, self._open, self._held = [], {}, {}
            raise

    def _renew_due(self, now: float) -> None:
        """An empty entry for each held stream without a call for renew_s: its lease renewed."""
        due = []
        for request_id, (owner, last) in self._held.items():
            if now - last < self.renew_s:
                break  # the others had a call later
            if request_id not in self._open:
                due.append((request_id, owner))
        for request_id, owner in due:
            self._queue(request_id, owner)

    async def _send(self, batch: list[_Entry], sent_at: float) -> None:
        try:
            written = await self._write(batch)
        except StateStoreError as exc:
            for entry in batch:
                self._held.pop(entry.request_id, None)
            _fail(batch, exc)
            return
        for entry, ok in zip(batch, written, strict=True):
            self._held.pop(entry.request_id, None)  # re-inserted last: the newest
            if ok and not entry.end:
                self._held[entry.request_id] = (entry.owner, sent_at)
            if not entry.done.done():
                entry.done.set_result(ok)

    @wrap_redis_errors
    async def _write(self, batch: list[_Entry]) -> list[bool]:
        k = self.keys
        streams = [[k.owner(e.request_id), k.events(e.request_id), k.stream(e.request_id),
                    e.owner, e.end, e.spec,
                    [x for ev in e.events for x in (f"0-{ev.id + 1}", ev.data, ev.out)]]
                   for e in batch]
        payload = json.dumps(streams, separators=(",", ":"))
        written = await self._script(args=[self.ttl_s, self.lease_ms, payload])
        return [c == "1" for c in written]

def _fail(batch: list[_Entry], exc: BaseException) -> None:
    """Fail every entry's future. Marked retrieved: a submitter that stopped looking (its stream
    went on or ended) must not make asyncio log it; one that awaits still gets it."""
    for entry in batch:
        if not entry.done.done():
            entry.done.set_exception(exc)
            entry.done.exception()
