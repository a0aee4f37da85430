"""`AdapterHosts` of a disaggregated cluster: load or unload an adapter on every registered
prefill and decode worker at once (gateway/lora.py), all or nothing.

    load    LoadLoRA on every worker, concurrently; if any fails, UnloadLoRA where it
            succeeded, then: ValueError (the worker's message) for a bad adapter
            (INVALID_ARGUMENT), BackendError for a worker that could not answer
    unload  UnloadLoRA on every worker; a worker not holding it (NOT_FOUND) is fine; if any
            refuses (FAILED_PRECONDITION: requests of it run or wait there), LoadLoRA again
            where it was unloaded, then LoRAInUseError naming the workers and their requests

A worker that registers later loads adapters on demand, from the path each request carries.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from engine.lora import LoRAInUseError, LoRARequest
from gateway.backend import BackendError
from gateway.worker_pool import WorkerPool
from pdserve.cluster.convert import lora_to_pb
from pdserve.cluster.registry import WorkerInfo
from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)
_Errors = list[tuple[WorkerInfo, grpc.aio.AioRpcError]]
_STUBS = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub}


class WorkerAdapters:
    def __init__(self, pool: WorkerPool, timeout_s: float = 120.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s  # reading an adapter from disk may take a while

    async def load(self, lora: LoRARequest) -> None:
        workers = await self._workers()
        request = common_pb2.LoadLoRARequest(adapter=lora_to_pb(lora))
        errors = await self._each(workers, "LoadLoRA", request)
        if not errors:
            return
        await self._undo(workers, errors, "UnloadLoRA",
                         common_pb2.UnloadLoRARequest(name=lora.lora_name))
        bad = [(w, e) for w, e in errors if e.code() == grpc.StatusCode.INVALID_ARGUMENT]
        if bad:
            raise ValueError(_describe(bad))
        raise BackendError(f"LoRA adapter {lora.lora_name!r} not loaded: {_describe(errors)}",
                           retryable=True)

    async def unload(self, lora: LoRARequest) -> None:
        workers = await self._workers()
        failed = await self._each(workers, "UnloadLoRA",
                                  common_pb2.UnloadLoRARequest(name=lora.lora_name))
        errors = [(w, e) for w, e in failed if e.code() != grpc.StatusCode.NOT_FOUND]
        if not errors:
            return
        await self._undo(workers, failed, "LoadLoRA",  # where it was unloaded
                         common_pb2.LoadLoRARequest(adapter=lora_to_pb(lora)))
        busy = [(w, e) for w, e in errors if e.code() == grpc.StatusCode.FAILED_PRECONDITION]
        if busy:
            raise LoRAInUseError(_describe(busy))
        raise BackendError(f"LoRA adapter {lora.lora_name!r} not unloaded: "
                           f"{_describe(errors)}", retryable=True)

    async def _workers(self) -> list[WorkerInfo]:
        workers = [w for w in await self.pool.list() if w.role in _STUBS]
        if not workers:
            raise BackendError("no prefill or decode worker is registered", retryable=True)
        return workers

    async def _each(self, workers: list[WorkerInfo], method: str, request: Any) -> _Errors:
        """`method` on every worker at once: the (worker, error) of those that failed."""
        results = await asyncio.gather(*(self._call(w, method, request) for w in workers))
        return [(w, e) for w, e in zip(workers, results) if e is not None]

    async def _call(self, worker: WorkerInfo, method: str, request: Any
                    ) -> grpc.aio.AioRpcError | None:
        async with self.pool.channel(worker.address) as channel:
            try:
                await getattr(_STUBS[worker.role](channel), method)(request,
                                                                    timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                return exc
        return None

    async def _undo(self, workers: list[WorkerInfo], failed: _Errors, method: str,
                    request: Any) -> None:
        """Roll back: `method` on the workers that did not fail (best effort, logged)."""
        failed_at = {w.address for w, _ in failed}
        done = [w for w in workers if w.address not in failed_at]
        for w, exc in await self._each(done, method, request):
            logger.warning("LoRA rollback (%s) on %s worker %s failed: %s", method, w.role,
                           w.address, exc.details())


def _describe(errors: _Errors) -> str:
    return "; ".join(f"{w.role} worker {w.address}: {e.details()}" for w, e in errors)
