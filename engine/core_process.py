"""The engine core in a process of its own (vLLM V1's EngineCore): the child's side.

NOTE: in one process the engine thread and the server's event loop share one interpreter lock.
At saturation a server's process runs at about one CPU (measured on a decode worker: the engine
thread held the lock 69% of the time, the event loop most of the rest), so HTTP or gRPC work and
the step's host work (scheduling, packing, launching, outputs) wait for each other. Here the
step loop runs in a child process and the server's process (engine/core_client.py) keeps the
network, the streams and the detokenization:

    server process                                   engine core process (this module)
    EngineCoreClient ──(op, call id, args)──▶ socket ──▶ [commands between steps ─▶ step]
          ▲                                                                   │
          └── reader thread ◀── ("outputs", [...]) · ("reply", id, ok, value) ◀┘

With `--listen PATH` other servers join the same engine (`EngineCoreClient.connect`; `pdserve
up --colocated --api-server-count N`): each connection gets the outputs of the requests it
added; one that goes away has its requests aborted; when the parent stops, the core finishes
the others' requests (at most STOP_DRAIN_S), then ends.

One Unix socket per server, messages in order: a command's reply comes before the outputs of
any step that ran after it, so an `add` is answered before its request's first output. Commands
run between steps exactly as `AsyncLLMEngine`'s do (add, abort, stats, LoRA adapters). Outputs
carry a request's prompt token ids once, with its first output (the client keeps them): each
later step's message stays the size of what is new.

Server -> core: ("start", model, kwargs, log_level, options) first (the parent; `options`: a
role's own, e.g. the decode role's KV transport), then (op, call_id, args) commands: add, abort,
stats, add_lora, remove_lora, stop (and a role's own: decode_svc/engine_core.py). Core ->
server messages (and a role's own):
  ("ready", facts)              the engine is built (facts: `CoreFacts`); also the first
                                message to a server that joins
  ("failed", exc)               building it raised; the process exits
  ("reply", call_id, ok, value) a command's result, or its exception (ok False)
  ("outputs", [Wire])           one step's outputs (of that server's requests), as tuples
                                (engine/output_wire.py)
  ("forget", request_id)        an aborted request: drop the prompt ids kept for it
  ("loras", [LoRARequest])      the adapters loaded now, whenever that set changes
  ("dead", exc)                 a step raised; no request can progress; the process exits
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import socket
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from engine import handover_trace, loop_profile
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from engine.loop_profile import LoopProfile
from engine.output_wire import FINISHED, REQUEST_ID, Wire, without_prompt_ids
from engine.stack_sampler import start_from_env
from engine.step_budget import with_server_budget
from engine.step_timeline import StepTimeline

logger = logging.getLogger(__name__)
NO_REPLY = 0  # a command's call id when nobody waits for its answer
STOP_DRAIN_S = 25.0  # the longest the others' requests may run on after the parent's stop
STOP_POLL_S = 0.2  # how often an idle, stopping loop looks whether it may end


@dataclasses.dataclass(frozen=True)
class CoreFacts:
    """What a server reads of its engine without a round trip (`AsyncLLMEngine.engine`'s
    attributes of the same names)."""

    model: str  # the resolved model path: the server loads its own tokenizer from it
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    loras: tuple[Any, ...]  # the adapters loaded at start (LoRARequest)


def main(argv: list[str] | None = None, core_class: type[Core] | None = None) -> None:
    """`python -m engine.core_process --fd N`: N is this end of a socket pair whose first
    message is ("start", model, kwargs, log_level, options): build the engine from `LLM`'s
    arguments, then serve commands and steps until told to stop or the parent's end closes. (A
    plain subprocess, not multiprocessing's spawn: that re-runs the parent's main script.)
    `core_class`: the loop serving it (a role's subclass of `Core`)."""
    core_class = core_class or Core
    parser = argparse.ArgumentParser(prog=f"python -m {core_class.__module__}")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--listen", default="", help="a Unix socket path other servers connect "
                        "to (EngineCoreClient.connect)")
    args = parser.parse_args(argv)
    role = "core" if core_class is Core else core_class.__module__.split(".")[0] + "-core"
    start_from_env(role)
    conn = Connection(args.fd)
    # Its life is the server's: the server stops it (after draining on SIGTERM, or on Ctrl-C)
    # or its end of the socket closes; a signal sent to the process group must not cut it first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        _, model, kwargs, log_level, options = conn.recv()
    except (EOFError, OSError):
        return
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(core_class.engine_config(model, kwargs, options))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", portable(exc)))
        return
    try:
        listener = _listen(args.listen) if args.listen else None
        core = core_class(engine, conn, listener, options)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", portable(exc)))
        engine.shutdown()
        return
    core.profile = loop_profile.from_env(role)
    core.timeline = StepTimeline.from_env(role)
    try:
        conn.send(("ready", core.facts))
        core.started()
        core.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent went away mid-send: nothing is left to serve
    finally:
        if core.profile is not None:
            core.profile.close()
        if core.timeline is not None:
            core.timeline.close()
        core.close()
        engine.shutdown()
        if listener is not None:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(args.listen)


def _listen(path: str) -> socket.socket:
    """A non-blocking Unix socket at `path` (a stale file of an earlier run replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.setblocking(False)
    return listener


class Core:
    """The step loop: commands between steps, each step's outputs in one message per server.

    The first connection is the parent's; with a listening socket other servers connect too
    (`pdserve up --colocated --api-server-count N`: N HTTP servers, one engine). A request's
    outputs go to the connection that added it; a server that goes away has its requests
    aborted; the parent going away ends the loop.

    A role's subclass (decode_svc/engine_core.py, prefill_svc/engine_core.py) adds commands to
    `handlers` (those in `per_server` are called with the asking connection first), builds its
    engine's config (`engine_config`), adds to the facts, and acts after every round of
    commands and step (`after_round`) or before a step's outputs leave (`before_outputs`)."""

    per_server = frozenset({"add", "abort"})

    def __init__(self, engine: LLMEngine, conn: Connection,
                 listener: socket.socket | None = None, options: dict | None = None) -> None:
        self.engine, self.parent, self.listener = engine, conn, listener
        self.facts = CoreFacts(engine.config.model, tuple(engine.eos_token_ids),
                               engine.max_model_len, engine.vocab_size,
                               tuple(engine.list_loras()))
        self.conns: list[Connection] = [conn]
        self.owner: dict[str, Connection] = {}  # request id -> the server that added it
        self.handlers: dict[str, Any] = {
            "add": self._add, "abort": self._abort, "stats": engine.stats,
            "add_lora": engine.add_lora, "remove_lora": engine.remove_lora,
        }
        self.prompt_sent: set[str] = set()  # requests whose prompt ids their server has
        self.loras = tuple(engine.list_loras())
        self.stopping_at = 0.0  # when the parent said stop (0: it has not)
        self.profile: LoopProfile | None = None  # PDSERVE_CPROFILE_DIR (engine/loop_profile.py)
        self.timeline: StepTimeline | None = None  # PDSERVE_STEP_TIMELINE (step_timeline.py)

    @staticmethod
    def engine_config(model: str | None, kwargs: dict, options: dict) -> Any:
        """The engine's config from `LLM`'s arguments and the server's step budget."""
        return build_engine_config(model, **with_server_budget(kwargs))

    def started(self) -> None:
        """After "ready" went to the parent, before the first command."""

    def after_round(self) -> None:
        """After each round of commands and each step (the moments blocks are freed)."""

    def before_outputs(self, outputs: list[Wire]) -> None:
        """After a step, before its outputs go to their servers (a role's messages about
        that step go first)."""

    def close(self) -> None:
        """The loop ended (before the engine shuts down)."""

    def run(self) -> None:
        while self._commands(self._wait_s()) and not self._stopped():
            if self.profile is not None:
                self.profile.tick()
            if self.engine.has_work() and not self.engine.step_delay_s():
                handover_trace.mark_all("step")
                try:
                    outputs = (self.engine.step_wire() if self.timeline is None
                               else self.timeline.step(self.engine.step_wire))
                except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
                    logger.exception("the engine's step failed")
                    for conn in list(self.conns):
                        self._send(conn, ("dead", portable(exc)))
                    return
                self.before_outputs(outputs)
                by_conn: dict[Connection, list[Wire]] = {}
                for wire in self._wire(outputs):
                    request_id = wire[REQUEST_ID]
                    conn = self.owner.get(request_id)
                    if wire[FINISHED]:
                        self.owner.pop(request_id, None)
                    if conn is not None:
                        by_conn.setdefault(conn, []).append(wire)
                for conn, batch in by_conn.items():
                    self._send(conn, ("outputs", batch))
                for wire in outputs:  # handed to its server (a handover's stamps end here)
                    handover_trace.mark(wire[REQUEST_ID], "yield")
            self.after_round()

    def _wait_s(self) -> float | None:
        """How long the next round may wait for a command: until the engine's next step may
        start (0 when it may now; later when its steps are paced, `step_delay_s`), or, idle,
        until one comes (None; while stopping, at most STOP_POLL_S)."""
        if self.engine.has_work():
            return self.engine.step_delay_s()
        return STOP_POLL_S if self.stopping_at else None

    def _commands(self, timeout: float | None) -> bool:
        """Run the commands waiting, having waited up to `timeout` seconds for one (None:
        until one comes). False when the loop must end: the parent is gone (its stop is
        `_stop`: the others' requests may still finish)."""
        waitables: list[Any] = [*self.conns, *([self.listener] if self.listener else [])]
        for ready in wait(waitables, timeout):
            if ready is self.listener:
                self._accept()
                continue
            while ready in self.conns and ready.poll(0):
                try:
                    message = ready.recv()
                except (EOFError, OSError):
                    if ready is self.parent:
                        return False
                    message = ("stop", NO_REPLY, ())
                if message[0] == "stop":
                    if ready is self.parent:
                        self._stop()
                    else:
                        self._drop(ready)
                    break
                self._run(ready, *message)
        return True

    def _stop(self) -> None:
        """The parent stops (it has drained its own requests): take no new server, and end
        once the others' requests are done, at most STOP_DRAIN_S from now."""
        self.stopping_at = time.monotonic()
        self._drop(self.parent)  # what it left running is abandoned
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def _stopped(self) -> bool:
        if not self.stopping_at:
            return False
        others_busy = any(conn in self.conns for conn in self.owner.values())
        return not others_busy or time.monotonic() - self.stopping_at > STOP_DRAIN_S

    def _run(self, conn: Connection, op: str, call_id: int, args: tuple) -> None:
        try:
            result = self.handlers[op](conn, *args) if op in self.per_server else (
                self.handlers[op](*args))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            if call_id != NO_REPLY:
                self._send(conn, ("reply", call_id, False, portable(exc)))
            else:
                logger.warning("%s%r failed: %s", op, args[:1], exc)
            return
        self._lora_changes()  # an add may have loaded one: known before the reply
        if call_id != NO_REPLY:
            self._send(conn, ("reply", call_id, True, result))

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        conn = Connection(sock.detach())
        self.conns.append(conn)
        self._send(conn, ("ready", dataclasses.replace(self.facts, loras=self.loras)))

    def _drop(self, conn: Connection) -> None:
        """A server went away: its requests are aborted (their blocks freed)."""
        self.conns.remove(conn)
        conn.close()
        for request_id in [r for r, c in self.owner.items() if c is conn]:
            del self.owner[request_id]
            self.prompt_sent.discard(request_id)
            self.engine.abort_request(request_id)

    def _send(self, conn: Connection, message: tuple) -> None:
        """To a server; a server other than the parent that is gone is dropped."""
        if conn not in self.conns:  # dropped, or the parent after its stop
            return
        try:
            conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            if conn is self.parent:
                raise BrokenPipeError("the parent is gone") from None
            if conn in self.conns:
                self._drop(conn)

    def _add(self, conn: Connection, request_id: str, prompt: Any, params: Any,
             prior: list[int] | None, lora_request: Any) -> None:
        self.prompt_sent.discard(request_id)
        self.engine.add_request(request_id, prompt, params, prior_output_token_ids=prior,
                                lora_request=lora_request)
        self.owner[request_id] = conn

    def _abort(self, conn: Connection, request_id: str) -> bool:
        if request_id in self.prompt_sent:  # no final output will tell the server to drop it
            self.prompt_sent.discard(request_id)
            self._send(conn, ("forget", request_id))
        self.owner.pop(request_id, None)
        return self.engine.abort_request(request_id)

    def _wire(self, outputs: list[Wire]) -> list[Wire]:
        """The step's outputs as they go to the servers: the prompt's token ids with a
        request's first output only (None after)."""
        sent_ids = self.prompt_sent
        wire = []
        for out in outputs:
            request_id = out[REQUEST_ID]
            sent = request_id in sent_ids
            if out[FINISHED]:
                sent_ids.discard(request_id)
            elif not sent:
                sent_ids.add(request_id)
            wire.append(without_prompt_ids(out) if sent else out)
        return wire

    def _lora_changes(self) -> None:
        loras = tuple(self.engine.list_loras())
        if loras != self.loras:
            self.loras = loras
            for conn in list(self.conns):
                self._send(conn, ("loras", loras))


def portable(exc: BaseException) -> BaseException:
    """`exc` if it crosses a pipe intact, else a RuntimeError naming its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        exc.__traceback__ = None
        return exc
    except Exception:  # noqa: BLE001 - any failure to pickle
        return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":  # run as the module itself, so that what it pickles names it
    from engine import core_process

    core_process.main()
