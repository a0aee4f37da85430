"""The decode worker's engine core in a process of its own: the child's side.

NOTE: why. A decode worker's gRPC server (Generate streams out, PushKV streams in) and its
engine's step loop shared one interpreter lock: on one H200 the split served 0.63x the output
tokens of the colocated server once that one ran its engine core in a process of its own (and
1.26x more for that alone). `pdserve decode --engine-core process` runs the step loop here, as
the colocated server's runs in engine/core_process.py, with the decode role's commands added:

    reserve(request_id, prompt, params, prior, max_waiting, lora)
                         the blocks now (a Reservation), or None: queued for free blocks,
                         a ("granted", request_id, Reservation | None) message follows once
                         they are free (None: aborted while queued)
    commit(request_id, first_token_id, logprobs)
                         no reply: the request joins the next step; a commit that fails
                         aborts it and sends ("failed", request_id, exc) to its stream
    describe(wanted, doorbell)
                         the pool as DescribeKV publishes it (decode_svc/pool.py): a data
                         plane's export must come from the process that allocated the memory
    prefix_events(full)  the prefix cache's events for KV-aware routing

The server keeps the rest of the receiving side (decode_svc/receiver.py: reservations'
bookkeeping, fences, timeouts, the commit doorbell). A grpc push's slabs are written there, into
this pool mapped in the server's process: on the CPU the pool lives in a memfd (sent after
"ready" as SCM_RIGHTS), on a GPU the server opens its CUDA IPC handle (torch's reduction, sent
in the facts) when the first grpc push comes. Data planes (cuda_ipc, nixl) write into the pool
here directly, as before. Tensor parallelism is refused: the pool of every rank is mapped in
rank 0, which is this process.
"""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection
from typing import Any

from decode_svc.pool import PoolExporter
from engine import core_process, handover_trace
from engine.core_pool import PoolCore, PoolFacts
from engine.core_process import Core, portable
from engine.kv_handoff import Reservation
from engine.kv_transfer import KVLayout
from engine.llm_engine import LLMEngine
from pdserve.transport.base import PoolInfo


@dataclasses.dataclass(frozen=True)
class DecodeFacts(PoolFacts):
    pool_id: str = ""
    offered: tuple[str, ...] = ()  # the KV transports this worker offers
    layout: KVLayout | None = None


class DecodeCore(PoolCore):
    ROLE = "decode"
    per_server = Core.per_server | {"reserve", "commit"}

    def __init__(self, engine: LLMEngine, conn: Connection, listener: Any = None,
                 options: dict | None = None) -> None:
        super().__init__(engine, conn, listener, options)
        pool = engine.runner.kv_pool
        self.exporter = PoolExporter(pool, (options or {}).get("kv_transport", "grpc"))
        self.queued: dict[str, Connection] = {}  # reservations waiting for blocks -> server
        self.handlers.update(reserve=self._reserve, commit=self._commit,
                             describe=self._describe)
        self.facts = self.pool_facts(DecodeFacts, pool_id=self.exporter.pool_id,
                                     offered=tuple(self.exporter.offered),
                                     layout=self.exporter.layout)

    def after_round(self) -> None:
        """Hand the blocks freed since to the reservations queued for them, in order."""
        for request_id, reservation in self.engine.grant_reservations():
            conn = self.queued.pop(request_id, None)
            if conn is not None:
                self._send(conn, ("granted", request_id, reservation))

    def close(self) -> None:
        self.exporter.close()

    def _reserve(self, conn: Connection, request_id: str, prompt: list[int], params: Any,
                 prior: list[int] | None, max_waiting: int, lora: Any) -> Reservation | None:
        reservation = self.engine.reserve_request(request_id, prompt, params, prior,
                                                  max_waiting=max_waiting, lora_request=lora)
        self.owner[request_id] = conn
        if reservation is None:
            self.queued[request_id] = conn
        return reservation

    def _commit(self, conn: Connection, request_id: str, first_token_id: int,
                logprobs: tuple[float, dict] | None) -> None:
        """Nobody waits for it: a failure (a bug: an aborted request is not one) ends the
        request's stream with the error."""
        handover_trace.mark(request_id, "commit_in")  # this process's stamps start here
        handover_trace.mark(request_id, "commit_run")
        try:
            self.engine.commit_request(request_id, first_token_id, logprobs)
        except Exception as exc:  # noqa: BLE001 - handed to the request's reader
            if self.engine.abort_request(request_id):
                self.owner.pop(request_id, None)
                self.prompt_sent.discard(request_id)
                self._send(conn, ("failed", request_id, portable(exc)))

    def _abort(self, conn: Connection, request_id: str) -> bool:
        if self.queued.pop(request_id, None) is not None:  # its reserve_remote hears None
            self._send(conn, ("granted", request_id, None))
        return super()._abort(conn, request_id)

    def _drop(self, conn: Connection) -> None:
        super()._drop(conn)
        self.queued = {r: c for r, c in self.queued.items() if c is not conn}

    def _describe(self, wanted: list[str], doorbell: str) -> PoolInfo:
        self.exporter.doorbell = doorbell
        return self.exporter.describe(wanted)



def main(argv: list[str] | None = None) -> None:
    """`python -m decode_svc.engine_core --fd N` (see engine/core_process.py's `main`)."""
    core_process.main(argv, DecodeCore)


if __name__ == "__main__":  # run as the module itself, so that what it pickles names it
    from decode_svc import engine_core

    engine_core.main()
