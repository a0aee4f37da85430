"""The one module that owns pdserve's Redis schema: keys, TTLs, request status and cancellation.

Nothing outside ``pdserve.cluster`` imports ``redis``; Redis failures surface as
``StateStoreError`` so callers can handle them without knowing the client library.

Key schema (``{p}`` is the cluster prefix, default ``pdserve``; two clusters may share a Redis):

    {p}:req:{request_id}             hash    request state, TTL ``RequestStore.ttl_s``
    {p}:cancel:{request_id}          string  "1" once cancelled, same TTL (the durable signal)
    {p}:cancel                       channel request ids published on cancel (best effort)
    {p}:worker:{role}:{worker_id}    string  JSON ``WorkerInfo``, TTL ``WorkerRegistry.ttl_s``
    {p}:stream:{request_id}          hash    a resumable stream's spec and ``done``, TTL
                                             ``EventLog.ttl_s`` (pdserve.cluster.event_log)
    {p}:events:{request_id}          stream  its SSE events (entry ``0-{n+1}`` is event n), same TTL
    {p}:owner:{request_id}           string  the gateway generating it, a lease of
                                             ``EventLog.lease_ms``
    {p}:lora                         hash    LoRA adapter name -> JSON ``LoRAModule``, the
                                             adapters every gateway serves; no TTL
                                             (pdserve.cluster.lora_catalog)

Request status machine (forward along the chain, skipping allowed; any non-terminal status may
also go to ``failed`` or ``cancelled``; terminal statuses are final):

    queued -> prefilling -> transferring -> decoding -> finished
       \\____________\\_____________\\_____________\\____> failed | cancelled

One way back: ``RequestStore.resume`` (a gateway continues a broken stream) moves any status but
``finished`` to ``queued`` and counts it in the ``resumes`` field.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import RedisError

DEFAULT_PREFIX = "pdserve"
CHAIN = ("queued", "prefilling", "transferring", "decoding", "finished")
TERMINAL = frozenset({"finished", "failed", "cancelled"})
STATUSES = frozenset(CHAIN) | TERMINAL
_RESERVED_FIELDS = frozenset({"status", "created_at"})
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]+")

if TYPE_CHECKING:
    from pdserve.cluster.cancel_listener import CancelListener

P = ParamSpec("P")
T = TypeVar("T")


class StateStoreError(RuntimeError):
    """Redis is unreachable, timed out, or answered with an error."""


class InvalidTransition(ValueError):
    """A status change the request state machine forbids (e.g. out of a terminal status)."""


class RequestNotFound(KeyError):
    """No state for this request id: never created, or expired."""


class RequestExists(ValueError):
    """``RequestStore.create`` was called for an id that already has state."""


def wrap_redis_errors(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Re-raise ``RedisError`` from ``fn`` as ``StateStoreError`` (for this package's modules),
    and deliver a cancellation ``fn`` swallowed.

    NOTE: redis-py sends each command under ``asyncio.wait_for`` (the socket timeout). Before
    Python 3.12, ``wait_for`` returns normally when its task is cancelled just as the send
    completes (CPython gh-86296), so the cancellation is lost: a gateway request whose client
    had gone away went on generating to its last token, holding its KV blocks all along. A
    cancellation requested during the call (``Task.cancelling()`` grew) is raised here.
    """

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        cancels = _cancelling()
        try:
            result = await fn(*args, **kwargs)
        except RedisError as e:
            raise StateStoreError(f"redis: {type(e).__name__}: {e}") from e
        if _cancelling() > cancels:
            raise asyncio.CancelledError
        return result

    return wrapper


def _cancelling() -> int:
    """Cancellations requested of the current task and not withdrawn (0 before Python 3.11)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None and hasattr(task, "cancelling") else 0


MAX_CONNECTIONS = 512  # per client; a busy gateway holds about two per open stream at peaks


def connect(url: str, *, timeout_s: float = 5.0, max_connections: int = MAX_CONNECTIONS
            ) -> Redis:
    """A lazy client for ``url`` (``redis://host:port/db``); no I/O until first use.

    Replies are decoded to ``str``; every class here expects a client made by this function.
    Its pool holds at most ``max_connections``; a command that finds them all busy waits up to
    ``timeout_s`` for one (redis-py's default pool of 100 raises at once instead: under a load
    of ~100 streams a gateway lost state and stream-log writes to it).
    """
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout_s, decode_responses=True,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
    )
    return Redis.from_pool(pool)


async def redis_ok(client: Redis, timeout_s: float = 1.0) -> bool:
    """True when Redis answers PING within ``timeout_s``. Never raises (for readiness probes)."""
    try:
        return bool(await asyncio.wait_for(client.ping(), timeout_s))
    except Exception:
        return False


@dataclass(frozen=True)
class Keys:
    """Every Redis key and channel name pdserve uses, under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        # No ':' or glob characters: a SCAN pattern must never match another cluster's keys.
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"prefix must match {_PREFIX_RE.pattern}, got {self.prefix!r}")

    def request(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}:cancel:{request_id}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    def worker(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}:worker:{role}:{worker_id}"

    def worker_pattern(self, role: str | None = None) -> str:
        return f"{self.prefix}:worker:{role}:*" if role else f"{self.prefix}:worker:*"

    def worker_index(self) -> str:
        """The registry's index: every worker entry's key, scored by when it expires."""
        return f"{self.prefix}:workers"

    def prefix_blocks(self, worker_id: str) -> str:
        """A worker's cached prefix block hashes (pdserve/cluster/prefix_index.py)."""
        return f"{self.prefix}:prefix:{worker_id}"

    def stream(self, request_id: str) -> str:
        return f"{self.prefix}:stream:{request_id}"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}:events:{request_id}"

    def owner(self, request_id: str) -> str:
        return f"{self.prefix}:owner:{request_id}"

    @property
    def lora_modules(self) -> str:
        """The served LoRA adapters (pdserve/cluster/lora_catalog.py)."""
        return f"{self.prefix}:lora"

    def response(self, response_id: str) -> str:
        """A stored Responses API response (pdserve/cluster/response_store.py)."""
        return f"{self.prefix}:response:{response_id}"


def allowed_transition(src: str, dst: str) -> bool:
    """Whether the state machine allows ``src -> dst`` (a repeat of a terminal status is not
    a transition: ``RequestStore.transition`` treats it as a no-op)."""
    if src not in STATUSES or dst not in STATUSES:
        raise ValueError(f"unknown status: {src!r} -> {dst!r}")
    if src in TERMINAL:
        return False
    if dst in ("failed", "cancelled"):
        return True
    return CHAIN.index(dst) > CHAIN.index(src)


def _to_str(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


# KEYS[1]: request hash. ARGV[1]: new status; ARGV[2]: ttl seconds; ARGV[3]: " src1 src2 ... "
# (statuses allowed to move to ARGV[1]); ARGV[4]: "1" if a repeat of ARGV[1] is a no-op;
# ARGV[5..]: field, value pairs to record (including ts_<status>).
_TRANSITION_LUA = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {'missing', ''} end
if cur == ARGV[1] and ARGV[4] == '1' then return {'noop', cur} end
if not string.find(ARGV[3], ' ' .. cur .. ' ', 1, true) then return {'invalid', cur} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {'ok', cur}
"""

# KEYS[1]: request hash. ARGV[1]: ttl seconds; ARGV[2]: now.
_RESUME_LUA = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {'missing', ''} end
if cur == 'finished' then return {'invalid', cur} end
redis.call('HSET', KEYS[1], 'status', 'queued', 'ts_resumed', ARGV[2])
local n = redis.call('HINCRBY', KEYS[1], 'resumes', 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {'ok', tostring(n)}
"""

# KEYS[1]: request hash. ARGV[1]: ttl seconds; ARGV[2..]: field, value pairs.
_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


class RequestStore:
    """Request state hashes and cancellation flags. Safe to share between coroutines; every
    status change is one atomic Lua script, so concurrent gateways cannot race a terminal
    request out of its final status."""

    def __init__(self, client: Redis, prefix: str = DEFAULT_PREFIX, ttl_s: int = 3600) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client = client
        self.keys = Keys(prefix)
        self.ttl_s = int(ttl_s)
        self._create = client.register_script(_CREATE_LUA)
        # creates in flight: a request's later writes from this store wait for its create (the
        # gateway does not wait for it on the request's way: RequestTracker)
        self._creating: dict[str, asyncio.Future[None]] = {}
        self._transition = client.register_script(_TRANSITION_LUA)
        self._resume = client.register_script(_RESUME_LUA)

    @wrap_redis_errors
    async def create(
        self, request_id: str, *, model: str, prompt_tokens: int, stream: bool, n: int = 1
    ) -> None:
        """Write a new request in status ``queued`` with ``created_at``/``ts_queued`` and the
        TTL. Raises ``RequestExists`` (and writes nothing) if the id already has state. The
        request's transitions and resumes through this store wait for it to land."""
        now = _to_str(time.time())
        fields = {"status": "queued", "created_at": now, "ts_queued": now, "model": model,
                  "prompt_tokens": prompt_tokens, "stream": stream, "n": n}
        args = [self.ttl_s, *(_to_str(x) for kv in fields.items() for x in kv)]
        landed = self._creating[request_id] = asyncio.get_running_loop().create_future()
        try:
            created = await self._create(keys=[self.keys.request(request_id)], args=args)
        finally:
            landed.set_result(None)
            if self._creating.get(request_id) is landed:
                del self._creating[request_id]
        if not created:
            raise RequestExists(request_id)

    async def _after_create(self, request_id: str) -> None:
        """Wait for the request's create, if this store is writing it now (whatever it did)."""
        landed = self._creating.get(request_id)
        if landed is not None:
            await asyncio.shield(landed)

    @wrap_redis_errors
    async def transition(self, request_id: str, status: str, **fields: object) -> None:
        """Atomically move the request to ``status``, recording ``ts_<status>`` = now and
        ``fields`` (stringified; bools as "1"/"0"; ``None`` values skipped), and refresh the TTL.

        Repeating the current terminal status is a no-op (nothing written). Raises
        ``InvalidTransition`` for a forbidden move (nothing written), ``RequestNotFound`` if the
        request has no state, ``ValueError`` for an unknown status or a reserved field name.
        """
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        bad = [k for k in fields if k in _RESERVED_FIELDS or k.startswith("ts_")]
        if bad:
            raise ValueError(f"reserved field names: {bad}")
        sources = " ".join(s for s in sorted(STATUSES) if allowed_transition(s, status))
        await self._after_create(request_id)
        record = {f"ts_{status}": time.time(), **{k: v for k, v in fields.items() if v is not None}}
        args = [status, self.ttl_s, f" {sources} ", "1" if status in TERMINAL else "0"]
        args += [_to_str(x) for kv in record.items() for x in kv]
        outcome, current = await self._transition(keys=[self.keys.request(request_id)], args=args)
        if outcome == "missing":
            raise RequestNotFound(request_id)
        if outcome == "invalid":
            raise InvalidTransition(f"request {request_id}: {current} -> {status} not allowed")

    @wrap_redis_errors
    async def resume(self, request_id: str) -> int:
        """Move a request whose stream broke back to ``queued`` (a gateway generates the rest),
        recording ``ts_resumed`` and counting ``resumes``; returns that count. Raises
        ``InvalidTransition`` for a ``finished`` request and ``RequestNotFound`` (nothing
        written either way)."""
        await self._after_create(request_id)
        args = [self.ttl_s, _to_str(time.time())]
        outcome, value = await self._resume(keys=[self.keys.request(request_id)], args=args)
        if outcome == "missing":
            raise RequestNotFound(request_id)
        if outcome == "invalid":
            raise InvalidTransition(f"request {request_id}: {value} cannot be resumed")
        return int(value)

    @wrap_redis_errors
    async def get(self, request_id: str) -> dict[str, str] | None:
        """The request's fields, or None if it has no state. Read only."""
        return await self.client.hgetall(self.keys.request(request_id)) or None

    @wrap_redis_errors
    async def cancel(self, request_id: str) -> None:
        """Set the durable cancel flag (TTL ``ttl_s``) and publish the id on the cancel channel
        for listening workers. Does not change the request's status: record ``cancelled`` with
        ``transition`` as well."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.cancel(request_id), "1", ex=self.ttl_s)
            pipe.publish(self.keys.cancel_channel, request_id)
            await pipe.execute()

    @wrap_redis_errors
    async def is_cancelled(self, request_id: str) -> bool:
        """Whether ``cancel`` was called for this id (within the flag's TTL). Read only."""
        return bool(await self.client.exists(self.keys.cancel(request_id)))

    def listen_cancellations(self) -> CancelListener:
        """A ``CancelListener`` on this store's cluster."""
        from pdserve.cluster.cancel_listener import CancelListener  # it imports this module

        return CancelListener(self.client, self.keys.prefix)
