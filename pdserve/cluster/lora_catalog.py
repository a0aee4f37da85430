"""The LoRA adapters a cluster serves, in Redis, so that every gateway agrees on which model
names are adapters and where they load from: one hash ``{p}:lora`` (``state.Keys``), adapter
name -> JSON ``LoRAModule``, no TTL (adapters stay until unloaded). Seeded by each gateway from
its --lora-modules (HSETNX: the first one's entry stays); changed by /v1/load_lora_adapter and
/v1/unload_lora_adapter at any gateway. gateway/lora.py's `AdapterCatalog`."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.cluster.lora import LoRAModule
from pdserve.cluster.state import DEFAULT_PREFIX, Keys, wrap_redis_errors

logger = logging.getLogger(__name__)


class RedisCatalog:
    def __init__(self, client: Any, prefix: str = DEFAULT_PREFIX) -> None:
        """`client`: a redis client made by `state.connect` (the registry's, say)."""
        self.client, self.keys = client, Keys(prefix)

    @wrap_redis_errors
    async def get(self, name: str) -> LoRAModule | None:
        value = await self.client.hget(self.keys.lora_modules, name)
        return None if value is None else LoRAModule.from_json(value)

    @wrap_redis_errors
    async def all(self) -> list[LoRAModule]:
        modules = []
        for name, value in sorted((await self.client.hgetall(self.keys.lora_modules)).items()):
            try:
                modules.append(LoRAModule.from_json(value))
            except (ValueError, TypeError) as exc:
                logger.warning("skipping malformed LoRA adapter entry %s: %s", name, exc)
        return modules

    @wrap_redis_errors
    async def add(self, module: LoRAModule) -> bool:
        return bool(await self.client.hsetnx(self.keys.lora_modules, module.name,
                                             module.to_json()))

    @wrap_redis_errors
    async def remove(self, name: str) -> bool:
        return bool(await self.client.hdel(self.keys.lora_modules, name))
