"""What prefill and decode workers share for LoRA: --lora-modules loaded at start, and the rpcs
(LoadLoRA, UnloadLoRA, ListLoRAs), thin: the engine does the work; its errors become the
statuses the gateway maps to HTTP:

    engine ValueError (bad adapter, LoRA off)  -> INVALID_ARGUMENT     -> 400
    KeyError (not held here)                   -> NOT_FOUND            -> (ignored on unload)
    LoRAInUseError (requests of it run/wait)   -> FAILED_PRECONDITION  -> 409
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from engine.lora import LoRAInUseError
from pdserve.cluster.convert import lora_from_pb, lora_to_pb
from pdserve.cluster.grpc_server import NotFoundError, PreconditionError
from pdserve.cluster.lora import parse_lora_modules
from protos import common_pb2

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)


async def preload_loras(engine: AsyncLLMEngine, args: argparse.Namespace) -> None:
    """Load --lora-modules into the engine before serving (a bad adapter fails the start)."""
    for module in parse_lora_modules(args.lora_modules):
        await engine.add_lora(module.request())
        logger.info("LoRA adapter %s loaded from %s", module.name, module.path)


class LoRARpcs:
    """Mixed into a worker's servicer, which sets `engine`."""

    engine: AsyncLLMEngine

    async def LoadLoRA(self, request: Any, context: Any) -> common_pb2.LoadLoRAResponse:
        await self.engine.add_lora(lora_from_pb(request.adapter))
        return common_pb2.LoadLoRAResponse()

    async def UnloadLoRA(self, request: Any, context: Any) -> common_pb2.UnloadLoRAResponse:
        try:
            await self.engine.remove_lora(request.name)
        except LoRAInUseError as exc:
            raise PreconditionError(str(exc)) from None
        except KeyError:
            raise NotFoundError(f"LoRA adapter {request.name!r} is not loaded here") from None
        return common_pb2.UnloadLoRAResponse()

    async def ListLoRAs(self, request: Any, context: Any) -> common_pb2.ListLoRAsResponse:
        return common_pb2.ListLoRAsResponse(
            adapters=[lora_to_pb(r) for r in self.engine.list_loras()])
