"""The engine core in a process of its own (vLLM V1's EngineCore): the child's side.

NOTE: in one process the engine thread and the server's event loop share one interpreter lock.
At saturation a server's process runs at about one CPU (measured on a decode worker: the engine
thread held the lock 69% of the time, the event loop most of the rest), so HTTP or gRPC work and
the step's host work (scheduling, packing, launching, outputs) wait for each other. Here the
step loop runs in a child process and the server's process (engine/core_client.py) keeps the
network, the streams and the detokenization:

    server process                                   engine core process (this module)
    EngineCoreClient ──(op, call id, args)──▶ pipe ──▶ [commands between steps ─▶ step]
          ▲                                                                   │
          └── reader thread ◀── ("outputs", [...]) · ("reply", id, ok, value) ◀┘

One pipe each way, messages in order: a command's reply comes before the outputs of any step
that ran after it, so an `add` is answered before its request's first output. Commands run
between steps exactly as `AsyncLLMEngine`'s do (add, abort, stats, LoRA adapters). Outputs
carry a request's prompt token ids once, with its first output (the client keeps them): each
later step's message stays the size of what is new.

Child -> parent messages:
  ("ready", facts)              the engine is built (facts: `CoreFacts`)
  ("failed", exc)               building it raised; the process exits
  ("reply", call_id, ok, value) a command's result, or its exception (ok False)
  ("outputs", [RequestOutput])  one step's outputs
  ("forget", request_id)        an aborted request: drop the prompt ids kept for it
  ("loras", [LoRARequest])      the adapters loaded now, whenever that set changes
  ("dead", exc)                 a step raised; no request can progress; the process exits
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any

from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.step_budget import with_server_budget

logger = logging.getLogger(__name__)
NO_REPLY = 0  # a command's call id when nobody waits for its answer


@dataclasses.dataclass(frozen=True)
class CoreFacts:
    """What a server reads of its engine without a round trip (`AsyncLLMEngine.engine`'s
    attributes of the same names)."""

    model: str  # the resolved model path: the server loads its own tokenizer from it
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    loras: tuple[Any, ...]  # the adapters loaded at start (LoRARequest)


def main(argv: list[str] | None = None) -> None:
    """`python -m engine.core_process --fd N`: N is this end of a socket pair whose first
    message is ("start", model, kwargs, log_level): build the engine from `LLM`'s arguments,
    then serve commands and steps until told to stop or the parent's end closes. (A plain
    subprocess, not multiprocessing's spawn: that re-runs the parent's main script.)"""
    parser = argparse.ArgumentParser(prog="python -m engine.core_process")
    parser.add_argument("--fd", type=int, required=True)
    conn = Connection(parser.parse_args(argv).fd)
    # Its life is the server's: the server stops it (after draining on SIGTERM, or on Ctrl-C)
    # or its end of the socket closes; a signal sent to the process group must not cut it first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        _, model, kwargs, log_level = conn.recv()
    except (EOFError, OSError):
        return
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(build_engine_config(model, **with_server_budget(kwargs)))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", portable(exc)))
        return
    conn.send(("ready", CoreFacts(engine.config.model, tuple(engine.eos_token_ids),
                                  engine.max_model_len, engine.vocab_size,
                                  tuple(engine.list_loras()))))
    try:
        _Core(engine, conn).run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent went away mid-send: nothing is left to serve
    finally:
        engine.shutdown()


class _Core:
    """The step loop: commands between steps, each step's outputs in one message."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self.handlers = {
            "add": self._add, "abort": self._abort, "stats": engine.stats,
            "add_lora": engine.add_lora, "remove_lora": engine.remove_lora,
        }
        self.prompt_sent: set[str] = set()  # requests whose prompt ids the parent has
        self.loras = tuple(engine.list_loras())

    def run(self) -> None:
        while self._commands(block=not self.engine.has_work()):
            if self.engine.has_work():
                try:
                    outputs = self.engine.step()
                except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
                    logger.exception("the engine's step failed")
                    self.conn.send(("dead", portable(exc)))
                    return
                if outputs:
                    self.conn.send(("outputs", self._wire(outputs)))

    def _commands(self, block: bool) -> bool:
        """Run the commands waiting (with `block`, wait for one first: the engine is idle).
        False when the loop must end: told to stop, or the parent is gone."""
        while self.conn.poll(None if block else 0):
            block = False
            try:
                op, call_id, args = self.conn.recv()
            except (EOFError, OSError):
                return False
            if op == "stop":
                return False
            try:
                result = self.handlers[op](*args)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                if call_id != NO_REPLY:
                    self.conn.send(("reply", call_id, False, portable(exc)))
                else:
                    logger.warning("%s%r failed: %s", op, args[:1], exc)
                continue
            self._lora_changes()  # an add may have loaded one: known before the reply
            if call_id != NO_REPLY:
                self.conn.send(("reply", call_id, True, result))
        return True

    def _add(self, request_id: str, prompt: Any, params: Any, prior: list[int] | None,
             lora_request: Any) -> None:
        self.prompt_sent.discard(request_id)
        self.engine.add_request(request_id, prompt, params, prior_output_token_ids=prior,
                                lora_request=lora_request)

    def _abort(self, request_id: str) -> bool:
        if request_id in self.prompt_sent:  # no final output will tell the parent to drop it
            self.prompt_sent.discard(request_id)
            self.conn.send(("forget", request_id))
        return self.engine.abort_request(request_id)

    def _wire(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The prompt's token ids go with a request's first output only (None after)."""
        wire = []
        for out in outputs:
            if out.request_id in self.prompt_sent:
                out = dataclasses.replace(out, prompt_token_ids=None)
            elif not out.finished:
                self.prompt_sent.add(out.request_id)
            if out.finished:
                self.prompt_sent.discard(out.request_id)
            wire.append(out)
        return wire

    def _lora_changes(self) -> None:
        loras = tuple(self.engine.list_loras())
        if loras != self.loras:
            self.loras = loras
            self.conn.send(("loras", loras))


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
