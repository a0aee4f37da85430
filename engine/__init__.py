"""pdserve's engine: the shared core every service builds on (no network code here)."""

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["CompletionOutput", "Logprob", "RequestOutput", "RequestOutputKind", "SamplingParams"]
