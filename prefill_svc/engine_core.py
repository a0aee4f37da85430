"""The prefill worker's engine core in a process of its own: the child's side.

NOTE: why. Under a burst of prompts a prefill worker's process ran at about one CPU: its gRPC
server (a Prefill rpc per prompt, each push's messages, the data-plane writes) and its engine's
step loop shared one interpreter lock, as the decode worker's did before its engine core
process (decode_svc/engine_core.py). `pdserve prefill --engine-core process` runs the step loop
here, as the colocated server's runs in engine/core_process.py, with the prefill role's
commands added:

    add_watched(request_id, prompt, params, prior, lora)
                         `add` for a request whose KV the server ships: once the step that
                         samples its first token has landed, a ("kv", [(request_id, block
                         ids)]) message goes before that step's outputs
    release(request_id)  its held blocks are shipped (or will never be): free them
    held()               the requests holding blocks (the server's KV leases)
    prefix_events(full)  the prefix cache's events for KV-aware routing

The server ships the KV from this pool mapped in its own process (engine/core_pool.py): the grpc
push gathers its slabs there, cuda_ipc and nixl write from there into the decode worker's pool.
So the server reads a request's blocks only once they are final and held: a held request is
never preempted and its blocks are freed only by the server's `release` (or an abort, after
which nothing it wrote is used), and on a GPU its step has landed before the note leaves. What
the in-thread engine does beyond that, notes layer group by layer group while the prompt is
computed (the grpc push overlapping the compute), is not done here: the push starts at the
first token. Tensor parallelism is refused: the pool of every rank would have to be mapped.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from engine import core_process
from engine.core_pool import PoolCore, PoolFacts
from engine.core_process import Core
from engine.llm_engine import LLMEngine
from engine.output_wire import FINISHED, REQUEST_ID, Wire


class PrefillCore(PoolCore):
    ROLE = "prefill"
    per_server = Core.per_server | {"add_watched"}

    def __init__(self, engine: LLMEngine, conn: Connection, listener: Any = None,
                 options: dict | None = None) -> None:
        super().__init__(engine, conn, listener, options)
        self.watched: set[str] = set()  # requests whose blocks go to their server when final
        self.handlers.update(add_watched=self._add_watched, release=engine.release,
                             held=lambda: list(engine.scheduler.held))
        self.facts = self.pool_facts(PoolFacts)

    def before_outputs(self, outputs: list[Wire]) -> None:
        """The blocks of each watched request whose first token this step sampled, to its
        server ahead of that token (a request that finished without holding blocks, aborted
        or failed, sends none)."""
        by_conn: dict[Connection, list[tuple[str, list[int]]]] = {}
        for out in outputs:
            rid = out[REQUEST_ID]
            if not out[FINISHED] or rid not in self.watched:
                continue
            self.watched.discard(rid)
            conn = self.owner.get(rid)
            if conn is not None and rid in self.engine.scheduler.held:
                by_conn.setdefault(conn, []).append((rid, self.engine.held_block_ids(rid)))
        for conn, blocks in by_conn.items():
            self._send(conn, ("kv", blocks))

    def _add_watched(self, conn: Connection, request_id: str, prompt: Any, params: Any,
                     *args: Any) -> None:
        if params is not None and params.n != 1:  # as the engine refuses a watch
            raise ValueError("only a prefill-role request with n = 1 can have its KV watched")
        self._add(conn, request_id, prompt, params, *args)
        self.watched.add(request_id)

    def _abort(self, conn: Connection, request_id: str) -> bool:
        self.watched.discard(request_id)
        return super()._abort(conn, request_id)

    def _drop(self, conn: Connection) -> None:
        gone = {r for r, c in self.owner.items() if c is conn}
        super()._drop(conn)
        self.watched -= gone



def main(argv: list[str] | None = None) -> None:
    """`python -m prefill_svc.engine_core --fd N` (see engine/core_process.py's `main`)."""
    core_process.main(argv, PrefillCore)


if __name__ == "__main__":  # run as the module itself, so that what it pickles names it
    from prefill_svc import engine_core

    engine_core.main()
