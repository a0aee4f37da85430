"""`EngineCoreClient`: `AsyncLLMEngine`'s serving API over an engine in a process of its own.

The step loop runs in a child process (engine/core_process.py says why and what crosses the
pipe); this side keeps what `AsyncLLMEngine` keeps on the event loop: one output queue per
request, callers' futures, abort on a stream closed early. A small command goes from the
caller's thread when the socket has room and nothing is queued before it; any other goes to a
writer thread (a full pipe never blocks an event loop); a reader thread hands each step's
outputs to their readers, one hop per event loop, and settles replies.

    event loop ──command──(──▶ writer thread)──pipe──▶ engine core process
         ▲                                                     │
         └── per-request asyncio.Queue ◀── reader thread ◀─────┘

NOTE: why inline. Through the writer thread a command waited for that thread to wake and take
the interpreter lock from the event loop: a Prefill's way into an idle engine core took 1.1 ms
on the 2-core box (its handler's own part 0.08 ms), 0.7 ms inline; 0.7-0.8 ms on an H100
host, 0.6-0.7 inline (`python -m pdserve.bench.ttft_breakdown`'s into_engine, 2026-12-06).

The child dying (killed, out of memory, a step that raised) ends every open stream and waiting
call with `EngineDeadError`, as the engine thread failing does in-process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from engine.core_process import NO_REPLY, CoreFacts
from engine.llm_engine import PromptInput
from engine.loop_hops import call_on_loops
from engine.lora.request import LoRARequest
from engine.output_wire import decode
from engine.outputs import RequestOutput
from engine.request_streams import EngineDeadError, RequestStreams, settle
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerStats

logger = logging.getLogger(__name__)
_STOP = object()  # ends the writer thread
# A command this small (pickled) goes from the caller's thread when the socket is writable: a
# Unix stream socket is writable with three quarters of its send buffer free, so it never blocks
INLINE_SEND_MAX = 4096
STOP_TIMEOUT_S = 30.0


class EngineFacts:
    """What the server reads of its engine without asking it (the names `LLMEngine` has):
    the facts the child sent once built, and the tokenizer, loaded here at its first use."""

    def __init__(self, facts: CoreFacts) -> None:
        self.model = facts.model
        self.eos_token_ids = list(facts.eos_token_ids)
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from engine.model_loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.model)
        return self._tokenizer


class EngineCoreClient:
    """The colocated role's `AsyncLLMEngine` API (generate, abort, stats, LoRA adapters) with
    the engine in another process: a child this server starts (`from_args`: blocks until the
    engine is built there, raises what building it raised, ValueError for bad arguments), or
    the engine core another server started with a listening socket (`connect`)."""

    def __init__(self, conn: Connection, facts: CoreFacts,
                 proc: subprocess.Popen | None = None) -> None:
        self._conn, self._proc = conn, proc
        self.engine = EngineFacts(facts)
        self._loras: list[LoRARequest] = list(facts.loras)
        self._stopping = False
        self._error: BaseException | None = None
        self._streams = RequestStreams("the engine core has failed")
        self._prompts: dict[str, list[int]] = {}  # reader thread only: prompt ids, by request
        self._calls: dict[int, asyncio.Future | concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # pickled commands, for the writer
        self._queued = 0  # commands put in the outbox and not yet sent (under `_count`)
        self._count = threading.Lock()  # held briefly, never across a blocking write
        self._wire = threading.Lock()  # held by whoever writes to the socket
        self._room = select.poll()
        self._room.register(conn.fileno(), select.POLLOUT)
        self._writer = threading.Thread(target=self._write, name="pdserve-core-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read, name="pdserve-core-reader",
                                        daemon=True)
        self._writer.start()
        self._reader.start()

    CORE_MODULE = "engine.core_process"  # the child's module (`python -m`)
    ROLES = ("colocated",)  # the roles its engine may serve

    @classmethod
    def from_args(cls, model: str | None = None, listen: str = "", options: dict | None = None,
                  **kwargs: Any) -> EngineCoreClient:
        """Start the engine core as a child with `AsyncLLMEngine.from_args`'s arguments (the
        server's step budget too); with `listen`, a Unix socket path at which other servers
        `connect` to the same engine. `options`: the role's own (a subclass's child reads
        them)."""
        role = kwargs.get("role", "colocated")
        if role not in cls.ROLES:
            raise ValueError(f"engine_core='process' serves the {' and '.join(cls.ROLES)} "
                             f"role{'s' * (len(cls.ROLES) > 1)} only, not {role!r}")
        mine, theirs = socket.socketpair()
        conn = Connection(mine.detach())
        argv = [sys.executable, "-m", cls.CORE_MODULE, "--fd", str(theirs.fileno())]
        proc = subprocess.Popen(  # not forked: no fork after torch and threads
            [*argv, *(["--listen", listen] if listen else [])], pass_fds=(theirs.fileno(),))
        theirs.close()
        conn.send(("start", model, kwargs, logging.getLogger().getEffectiveLevel(),
                   options or {}))
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            proc.wait(STOP_TIMEOUT_S)
            raise RuntimeError(f"the engine core process exited ({proc.returncode}) before "
                               "its engine was built") from None
        if kind == "failed":
            proc.wait(STOP_TIMEOUT_S)
            raise value
        try:
            return cls(conn, value, proc)
        except BaseException:
            proc.kill()
            proc.wait()
            conn.close()
            raise

    @classmethod
    def connect(cls, path: str, timeout_s: float = 600.0) -> EngineCoreClient:
        """Join the engine core listening at `path`, waiting up to `timeout_s` for it to be
        there (the server that starts it may still be building the engine)."""
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no engine core listening at {path} after "
                                       f"{timeout_s:g} s") from None
                time.sleep(0.2)
        conn = Connection(sock.detach())
        try:
            _, facts = conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the engine core at {path} closed the connection") from None
        return cls(conn, facts)

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self, prompt: PromptInput, sampling_params: SamplingParams | None, request_id: str,
        prior_output_token_ids: list[int] | None = None, kv_watch: Any = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`AsyncLLMEngine.generate`: outputs until the request finishes; leaving early aborts
        it; bad input raises ValueError (from the engine's own checks) before anything runs."""
        if kv_watch is not None:
            raise ValueError("kv_watch: only a prefill worker's engine core process watches KV")
        async with aclosing(self._added("add", request_id, prompt, sampling_params,
                                        prior_output_token_ids, lora_request)) as outputs:
            async for out in outputs:
                yield out

    async def _added(self, op: str, request_id: str, *args: Any
                     ) -> AsyncIterator[RequestOutput]:
        """The request added by the command `op` (`args` after its id), then its outputs."""
        self._open(request_id)
        try:
            await self._call(op, request_id, *args)
        except asyncio.CancelledError:
            self._streams.discard(request_id)
            self._send("abort", NO_REPLY, request_id)  # after the add, whatever it did
            raise
        except BaseException:
            self._streams.discard(request_id)
            raise
        async with aclosing(self._consume(request_id)) as outputs:  # closed with us: aborts first
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is; its stream ends without a final output. True if the
        engine knew it."""
        found = await self._call("abort", request_id)
        self._streams.end(request_id)
        return found

    async def stats(self) -> SchedulerStats:
        return await self._call("stats")

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter now (ValueError if it is bad)."""
        await self._call("add_lora", lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter (KeyError, LoRAInUseError)."""
        await self._call("remove_lora", lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now, as the child last reported them."""
        return list(self._loras)

    @property
    def is_running(self) -> bool:
        """False once the engine core process failed, exited or was shut down."""
        alive = self._proc is None or self._proc.poll() is None
        return self._error is None and not self._stopping and alive

    @property
    def failure(self) -> BaseException | None:
        return self._error

    def shutdown(self) -> None:
        """Stop the engine core process (this server's requests in flight are abandoned;
        those of servers that joined it finish first, for at most
        core_process.STOP_DRAIN_S); a server that joined another's engine core only leaves
        it."""
        if self._stopping:
            return
        self._stopping = True
        self._send("stop", NO_REPLY)
        self._outbox.put(_STOP)
        if self._proc is None:  # another server's engine core: only this connection ends
            self._writer.join(STOP_TIMEOUT_S)
            self._conn.close()
            return
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the engine core process did not stop in %g s: killed", STOP_TIMEOUT_S)
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

    # ---- event-loop side -----------------------------------------------------------------
    async def _call(self, op: str, *args: Any) -> Any:
        if self._error is not None:
            raise EngineDeadError("the engine core has failed") from self._error
        if self._stopping:
            raise EngineDeadError("the engine core client was shut down")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        if self._error is not None:  # failed meanwhile: `_fail` may have missed this future
            self._calls.pop(call_id)
            raise EngineDeadError("the engine core has failed") from self._error
        self._send(op, call_id, *args)
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def call_blocking(self, op: str, *args: Any, timeout_s: float = STOP_TIMEOUT_S) -> Any:
        """`_call` for a caller off the event loop (a worker thread): waits for the reply."""
        if self._error is not None:
            raise EngineDeadError("the engine core has failed") from self._error
        if self._stopping:
            raise EngineDeadError("the engine core client was shut down")
        call_id = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        if self._error is not None:
            self._calls.pop(call_id)
            raise EngineDeadError("the engine core has failed") from self._error
        self._send(op, call_id, *args)
        try:
            return future.result(timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def _send(self, op: str, call_id: int, *args: Any) -> None:
        """Send a command, in order with those before it: now, from this thread, when it is
        small, nothing is queued and the socket is writable (so the write cannot block); else
        through the writer thread."""
        data = bytes(ForkingPickler.dumps((op, call_id, args)))
        with self._count:
            if (not self._queued and len(data) <= INLINE_SEND_MAX
                    and self._wire.acquire(blocking=False)):
                try:
                    if self._room.poll(0):
                        with contextlib.suppress(OSError, ValueError):  # the child is gone:
                            self._conn.send_bytes(data)  # the reader says so
                        return
                finally:
                    self._wire.release()
            self._queued += 1
            self._outbox.put(data)

    def _open(self, request_id: str) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine core has failed") from self._error
        self._streams.open(request_id)

    def _consume(self, request_id: str) -> AsyncIterator[RequestOutput]:
        return self._streams.consume(request_id, lambda: self._abort_left(request_id))

    async def _abort_left(self, request_id: str) -> None:
        """A reader left before its request finished: abort it, unless nothing runs it now."""
        if self._error is None and not self._stopping:
            await self._call("abort", request_id)

    # ---- the pipe's threads --------------------------------------------------------------
    def _write(self) -> None:
        while (data := self._outbox.get()) is not _STOP:
            try:
                with self._wire:
                    self._conn.send_bytes(data)
            except (OSError, ValueError):  # the child is gone: the reader says so
                return
            finally:
                with self._count:
                    self._queued -= 1

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed by another thread
                break  # meanwhile (multiprocessing's Connection then reads a None handle)
            kind = message[0]
            if kind == "outputs":
                self._deliver([decode(wire) for wire in message[1]])
            elif kind == "reply":
                self._reply(*message[1:])
            elif kind == "forget":
                self._prompts.pop(message[1], None)
            elif kind == "loras":
                self._loras = list(message[1])
            elif kind == "dead":
                self._fail(message[1])
                return
            else:
                self._role_message(message)
        if not self._stopping:
            code = None
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self._proc.wait(1.0)
            self._fail(RuntimeError(f"the engine core process exited ({code})"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their readers, one hop per event loop; each gets its prompt's
        token ids back (the child sends them with a request's first output only)."""
        for out in outputs:
            if out.prompt_token_ids is None:
                out.prompt_token_ids = self._prompts.get(out.request_id, [])
            elif not out.finished:
                self._prompts[out.request_id] = out.prompt_token_ids
            if out.finished:
                self._prompts.pop(out.request_id, None)
        call_on_loops(self._streams.output_calls(outputs))

    def _role_message(self, message: tuple) -> None:
        """A message of a role's own commands (a subclass's), on the reader thread."""
        logger.warning("the engine core sent an unknown message %r", message[0])

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._calls.get(call_id)
        if isinstance(future, concurrent.futures.Future):  # `call_blocking`'s
            settle(future, value if ok else None, None if ok else value)  # thread-safe
        elif future is not None:
            future.get_loop().call_soon_threadsafe(settle, future, value if ok else None,
                                                   None if ok else value)

    def _fail(self, exc: BaseException) -> None:
        logger.error("the engine core failed: %s", exc)
        self._error = exc
        self._streams.fail_all(exc)
        dead = EngineDeadError("the engine core has failed")
        dead.__cause__ = exc
        for future in list(self._calls.values()):
            if isinstance(future, concurrent.futures.Future):
                settle(future, None, dead)
            else:
                future.get_loop().call_soon_threadsafe(settle, future, None, dead)

