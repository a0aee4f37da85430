"""`DecodeCoreClient`: the decode role's `AsyncLLMEngine` API over an engine core process
(decode_svc/engine_core.py says why and what crosses the socket).

It adds to `PoolCoreClient` (engine/core_pool.py: the pool mapped here, `prefix_events`) what
`KVReceiver` and the Decode service call: reserve_remote (a reservation queued for free blocks
waits here for its "granted" message), commit_remote / commit_here (a command nobody waits
for), stream, the pool's description for DescribeKV (`CorePoolExporter`), and the pool's
layers for the grpc push's slabs (`kv_caches`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from multiprocessing.connection import Connection
from typing import Any

import torch

from decode_svc.engine_core import DecodeFacts
from engine.config import NO_KV_WAIT, KVWaitConfig
from engine.core_pool import PoolCoreClient
from engine.core_process import NO_REPLY
from engine.kv_handoff import Reservation
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.request_streams import EngineDeadError, RequestFailed, settle
from engine.reservation_wait import await_reservation
from engine.sampling_params import SamplingParams
from pdserve.transport.base import GRPC, PoolInfo

logger = logging.getLogger(__name__)


class DecodeCoreClient(PoolCoreClient):
    CORE_MODULE = "decode_svc.engine_core"
    ROLES = ("decode",)

    def __init__(self, conn: Connection, facts: DecodeFacts, proc: Any = None) -> None:
        self._granted: dict[str, asyncio.Future] = {}  # reservations queued for blocks
        super().__init__(conn, facts, proc)

    # ---- the decode role -----------------------------------------------------------------
    async def reserve_remote(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
        prior_output_token_ids: list[int] | None = None, wait: KVWaitConfig = NO_KV_WAIT,
        lora_request: LoRARequest | None = None,
    ) -> Reservation | None:
        """`AsyncLLMEngine.reserve_remote`: the blocks, waiting for them as `wait` allows;
        None if aborted while waiting; KVCacheFullError / ValueError keeping nothing."""
        self._open(request_id)
        granted = self._granted[request_id] = asyncio.get_running_loop().create_future()
        try:
            return await await_reservation(
                request_id, self._call("reserve", request_id, prompt_token_ids, sampling_params,
                                       prior_output_token_ids, wait.max_waiting, lora_request),
                granted, wait, self._streams, lambda: self.abort(request_id),
                lambda: self._send("abort", NO_REPLY, request_id))
        finally:
            self._granted.pop(request_id, None)

    async def commit_remote(
        self, request_id: str, first_token_id: int, logprobs: tuple[float, dict] | None
    ) -> None:
        """`AsyncLLMEngine.commit_remote`: queued, not waited for (commands run in order)."""
        self.commit_here(request_id, first_token_id, logprobs)

    def commit_here(
        self, request_id: str, first_token_id: int, logprobs: tuple[float, dict] | None
    ) -> None:
        """The commit from any thread (the doorbell's): the request's KV is in place. Slabs
        this process wrote into a GPU pool are on the device before the engine reads them."""
        if self._error is None and not self._stopping:
            pool = self.pool.opened
            if pool is not None and pool.device.type == "cuda":
                torch.cuda.synchronize(pool.device)
            self._send("commit", NO_REPLY, request_id, first_token_id, logprobs)

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a request registered by `reserve_remote`; closing early aborts it."""
        if request_id not in self._streams:
            raise KeyError(f"request {request_id!r} is not open")
        async with aclosing(self._consume(request_id)) as outputs:  # closed with us: aborts first
            async for out in outputs:
                yield out

    def kv_caches(self) -> list[torch.Tensor]:
        """Per layer, the engine core's KV cache mapped here (a GPU pool by its CUDA IPC
        handle, at the first call: a server whose pushes all come over a data plane never
        opens it)."""
        return list(self.pool.tensor().unbind(0))

    # ---- the reader thread ---------------------------------------------------------------
    def _role_message(self, message: tuple) -> None:
        kind, request_id, value = message
        if kind == "granted":
            future = self._granted.get(request_id)
            if future is not None:
                future.get_loop().call_soon_threadsafe(settle, future, value, None)
        elif kind == "failed":
            self._streams.put(request_id, RequestFailed(value))
        else:
            super()._role_message(message)

    def _fail(self, exc: BaseException) -> None:
        super()._fail(exc)
        dead = EngineDeadError("the engine core has failed")
        dead.__cause__ = exc
        for future in list(self._granted.values()):
            future.get_loop().call_soon_threadsafe(settle, future, None, dead)


class CorePoolExporter:
    """`PoolExporter`'s face for a pool that lives in the engine core process: DescribeKV's
    answer comes from there (a data plane exports from the allocating process); which planes
    were exported is remembered here, for `accepts`."""

    def __init__(self, engine: DecodeCoreClient) -> None:
        self.engine = engine
        self.pool_id = engine.facts.pool_id
        self.offered = engine.facts.offered
        self.layout = engine.facts.layout
        self.doorbell = ""
        self._exported: set[str] = set()

    def describe(self, wanted: list[str]) -> PoolInfo:
        """Off the event loop (it waits for the engine core's answer)."""
        info = self.engine.call_blocking("describe", wanted, self.doorbell)
        self.offered = tuple(info.transports)
        self._exported.update(t for t in wanted if t in self.offered and t != GRPC)
        return info

    def accepts(self, transport: str) -> bool:
        return transport in self.offered and transport in self._exported

    def close(self) -> None:
        """The planes close with the engine core process."""
