"""`PrefillCoreClient`: the prefill role's `AsyncLLMEngine` API over an engine core process
(prefill_svc/engine_core.py says why and what crosses the socket).

It adds to `PoolCoreClient` (engine/core_pool.py: the pool mapped here, `prefix_events`) what
the Prefill service, its KV sender and its leases call: `watch_kv` and `generate(...,
kv_watch=)` (the request's KV noted final once, when its first token is sampled), `release`,
`held_requests`, and the pool as a tensor (`kv_pool`) for the pushes to read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.core_pool import PoolCoreClient, PoolFacts
from engine.kv_progress import KVProgress
from engine.llm_engine import PromptInput
from engine.loop_hops import call_on_loops
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class CoreKVWatch:
    """`KVWatch`'s face for a request computed in the engine core process: one note, all of
    its KV final, when the step that sampled its first token has landed. Its blocks are held
    from then until `release`, so a read needs no lock and is never stale (epoch 0 throughout;
    an abort frees them, and then nothing read from them is used)."""

    epoch = 0

    def __init__(self, notify: Callable[[KVProgress], None], loop: asyncio.AbstractEventLoop,
                 num_layers: int) -> None:
        self.notify, self.loop, self.num_layers = notify, loop, num_layers
        self.total_tokens = 0  # set when the request is added: its prompt and prior outputs

    @contextmanager
    def reading(self, epoch: int) -> Iterator[bool]:
        yield epoch == self.epoch

    def note(self, block_ids: list[int]) -> KVProgress:
        n = self.total_tokens
        return KVProgress(self.num_layers, n, n, tuple(block_ids), self.epoch)


class PrefillCoreClient(PoolCoreClient):
    CORE_MODULE = "prefill_svc.engine_core"
    ROLES = ("prefill",)

    def __init__(self, conn: Connection, facts: PoolFacts, proc: Any = None) -> None:
        self._watches: dict[str, CoreKVWatch] = {}  # watched requests until their note
        super().__init__(conn, facts, proc)

    # ---- the prefill role ----------------------------------------------------------------
    def kv_pool(self) -> torch.Tensor:
        """The engine core's pool, [L, 2, N, block_size, Hkv, D], mapped here (a GPU pool by
        its CUDA IPC handle at the first call)."""
        return self.pool.tensor()

    def watch_kv(self, on_progress: Callable[[KVProgress], None],
                 layers_per_group: int = 1) -> CoreKVWatch:
        """A watch for `generate(..., kv_watch=)`: its note reaches `on_progress` on the
        calling event loop (`layers_per_group` is moot: there is one note, at the end)."""
        return CoreKVWatch(on_progress, asyncio.get_running_loop(),
                           self.kv_pool().shape[0])

    async def generate(
        self, prompt: PromptInput, sampling_params: SamplingParams | None, request_id: str,
        prior_output_token_ids: list[int] | None = None, kv_watch: Any = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`AsyncLLMEngine.generate`, with `kv_watch` (a `watch_kv`) told of the request's
        blocks before its first token comes out."""
        op, args = "add", (prompt, sampling_params, prior_output_token_ids, lora_request)
        if kv_watch is not None:
            if not isinstance(kv_watch, CoreKVWatch):
                raise ValueError("kv_watch: make it with this engine's watch_kv")
            if not isinstance(prompt, list):
                raise ValueError("prompt: a watched request's prompt is its token ids")
            kv_watch.total_tokens = len(prompt) + len(prior_output_token_ids or [])
            op, self._watches[request_id] = "add_watched", kv_watch
        try:
            async with aclosing(self._added(op, request_id, *args)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self._watches.pop(request_id, None)

    async def release(self, request_id: str) -> bool:
        """Free a finished request's held blocks (its KV is shipped, or never will be); False
        if it held none."""
        return await self._call("release", request_id)

    async def held_requests(self) -> list[str]:
        """The finished requests holding blocks now."""
        return await self._call("held")

    # ---- the reader thread ---------------------------------------------------------------
    def _role_message(self, message: tuple) -> None:
        if message[0] != "kv":
            super()._role_message(message)
            return
        calls = []
        for request_id, block_ids in message[1]:
            watch = self._watches.pop(request_id, None)
            if watch is not None:
                calls.append((watch.loop, watch.notify, watch.note(block_ids)))
        call_on_loops(calls)
