"""pdserve: LLM serving with disaggregated prefill and decode.

    from pdserve import LLM, SamplingParams, StructuredOutputsParams
    outputs = LLM().generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
    yes_no = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

The engine (and torch) load on first use of these names, so `pdserve.cluster` and the CLI's
help stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLMEngine": "engine.async_engine",
    "CompletionOutput": "engine.outputs",
    "LoRARequest": "engine.lora.request",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured.params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
