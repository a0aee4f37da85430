"""LoRA adapters at the gateway (vLLM's `--enable-lora` serving): which model names are adapters,
and loading or unloading them at run time.

    /v1/models                 the base model, then each adapter (root: its path, parent: the
                               model it adapts)
    model=<adapter name>       `resolve` -> the LoRARequest the backend generates under
    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: loaded (and so checked) on the
                                  engine, or on every worker, then recorded
    POST /v1/unload_lora_adapter  {"lora_name"}: unloaded there, then forgotten; refused (409)
                                  while requests of it run or wait, never waited for

Two seams, two implementations each:

    AdapterCatalog  the name -> adapter map: in this process (colocated), or in Redis so that
                    every gateway of a cluster agrees (pdserve/cluster/lora_catalog.py)
    AdapterHosts    where adapters load: the in-process engine (`EngineAdapters`), or every
                    registered worker (gateway/remote_lora.py)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from engine.lora import LoRAInUseError, LoRARequest
from gateway.backend import BackendError
from gateway.errors import OpenAIError
from pdserve.cluster.lora import LoRAModule
from pdserve.cluster.state import StateStoreError

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AdapterCatalog(Protocol):
    async def get(self, name: str) -> LoRAModule | None: ...

    async def all(self) -> list[LoRAModule]:
        """Every adapter, by name."""
        ...

    async def add(self, module: LoRAModule) -> bool:
        """Record `module`; False (nothing changes) when its name is taken."""
        ...

    async def remove(self, name: str) -> bool:
        """Forget `name`; False when it was not there."""
        ...


class AdapterHosts(Protocol):
    async def load(self, lora: LoRARequest) -> None:
        """Load `lora` everywhere requests may run (all or nothing): ValueError with the
        engine's message when it is bad anywhere."""
        ...

    async def unload(self, lora: LoRARequest) -> None:
        """Unload `lora` everywhere (all or nothing; a host not holding it is fine):
        LoRAInUseError while requests of it run or wait anywhere."""
        ...


class MemoryCatalog:
    """`AdapterCatalog` in this process: one gateway (the colocated `pdserve serve`)."""

    def __init__(self) -> None:
        self._modules: dict[str, LoRAModule] = {}

    async def get(self, name: str) -> LoRAModule | None:
        return self._modules.get(name)

    async def all(self) -> list[LoRAModule]:
        return sorted(self._modules.values(), key=lambda m: m.name)

    async def add(self, module: LoRAModule) -> bool:
        if module.name in self._modules:
            return False
        self._modules[module.name] = module
        return True

    async def remove(self, name: str) -> bool:
        return self._modules.pop(name, None) is not None


class EngineAdapters:
    """`AdapterHosts` for the in-process engine (colocated)."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    async def load(self, lora: LoRARequest) -> None:
        await self.engine.add_lora(lora)

    async def unload(self, lora: LoRARequest) -> None:
        with contextlib.suppress(KeyError):  # evicted from the host cache already (LRU)
            await self.engine.remove_lora(lora.lora_name)


@dataclass
class LoRAModels:
    """The adapters a gateway serves, over a catalog and the hosts adapters load on. A catalog
    that cannot answer (Redis down) is a BackendError (retryable: 503)."""

    catalog: AdapterCatalog
    hosts: AdapterHosts

    async def resolve(self, name: str) -> LoRARequest | None:
        """The adapter called `name`; None if there is none."""
        module = await self._catalog(self.catalog.get(name))
        return None if module is None else module.request()

    async def modules(self) -> list[LoRAModule]:
        """Every adapter served, by name (/v1/models)."""
        return await self._catalog(self.catalog.all())

    async def seed(self, modules: list[LoRAModule]) -> None:
        """Serve --lora-modules: each recorded unless a gateway recorded its name already
        (gateways of one cluster start with the same flags); loading is the workers' (they
        preload them) or the engine's (on first use)."""
        for module in modules:
            if not await self.catalog.add(module):
                known = await self.catalog.get(module.name)
                if known is not None and known.path != module.path:
                    logger.warning("LoRA adapter %s is served from %s already; --lora-modules "
                                   "says %s: unload it first to change it", module.name,
                                   known.path, module.path)

    async def load(self, name: str | None, path: str | None, base_model: str) -> str:
        """POST /v1/load_lora_adapter (vLLM's checks and messages). OpenAIError: 400 for a
        missing field, a name served already (or the base model's), a bad adapter."""
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.")
        try:
            module = LoRAModule(name, path)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="lora_name") from None
        if name == base_model or await self.resolve(name) is not None:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.",
                              param="lora_name")
        try:
            await self.hosts.load(module.request())
        except ValueError as exc:
            raise OpenAIError(f"Failed to load LoRA adapter '{name}': {exc}",
                              param="lora_path") from None
        if not await self._catalog(self.catalog.add(module)):  # another gateway won the race
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.",
                              param="lora_name")
        logger.info("LoRA adapter %s loaded from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str | None) -> str:
        """POST /v1/unload_lora_adapter. OpenAIError: 400 without a name, 404 for an unknown
        one, 409 naming the adapter and its requests while any run or wait."""
        if not name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.")
        lora = await self.resolve(name)
        if lora is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", status=404,
                              param="lora_name", code="model_not_found")
        try:
            await self.hosts.unload(lora)
        except LoRAInUseError as exc:
            raise OpenAIError(f"The lora adapter '{name}' is in use: {exc}", status=409,
                              param="lora_name", code="lora_adapter_in_use") from None
        await self._catalog(self.catalog.remove(name))
        logger.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    @staticmethod
    async def _catalog(call: Awaitable[T]) -> T:
        try:
            return await call
        except StateStoreError as exc:
            raise BackendError(f"the LoRA adapter catalog is unreachable: {exc}",
                               retryable=True) from exc
