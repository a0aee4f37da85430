"""One request's timeline as the client saw it: the unit every statistic is computed from.

All times are seconds on one monotonic clock, relative to the start of the run (the moment the
first request was due), so a saved report can be re-analysed without knowing the host's clock:

    scheduled_at  sent_at        chunk_at[0]    chunk_at[1]  ...  chunk_at[-1]    done_at
        |------------|----------------|--------------|-- ... --|-------------|
        client queue |<---- TTFT ---->|<-- ITL[0] -->|          (usage chunk, [DONE])
        (--max-      |<----------------------- E2E ---------------------------->|
        concurrency)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """A request's plan (what was asked) and, once run, what came back and when."""

    index: int  # position in the run's workload
    prompt_len: int  # prompt tokens by the workload's tokenizer (chat: the message text only)
    output_len: int  # max_tokens asked
    scheduled_at: float = 0.0  # when the arrival process said it was due
    sent_at: float = 0.0  # when the request left (after waiting for a concurrency slot)
    chunk_at: list[float] = field(default_factory=list)  # SSE events carrying output text
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk, where the server
    # said (logprobs); empty otherwise
    done_at: float = 0.0  # end of the stream
    prompt_tokens: int | None = None  # usage, as the server counted them
    completion_tokens: int | None = None
    request_id: str = ""
    error: str = ""  # "" when the request succeeded

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage, else the chunk token counts, else chunks."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        if self.chunk_tokens:
            return sum(self.chunk_tokens)
        return len(self.chunk_at)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("scheduled_at", "sent_at", "done_at"):
            data[key] = round(data[key], 6)
        data["chunk_at"] = [round(t, 6) for t in self.chunk_at]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)
