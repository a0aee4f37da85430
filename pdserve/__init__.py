"""pdserve: LLM serving with disaggregated prefill and decode.

    from pdserve import LLM, SamplingParams
    outputs = LLM().generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
"""

from engine.async_engine import AsyncLLMEngine
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
