"""Where stored responses live, for `previous_response_id` and `GET /v1/responses/{id}`: each
response's object and its conversation (the chat messages a next response continues from:
every earlier input and output, without instructions, which OpenAI does not carry over).

In-process (`MemoryResponses`) for a colocated gateway; in Redis, shared by every gateway of a
cluster, with a TTL (`pdserve/cluster/response_store.py`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the ResponseObject as JSON
    messages: list[dict[str, Any]]  # the conversation up to and including its output


class ResponseStore(Protocol):
    async def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored` under `response_id` (replacing one there) for the store's TTL."""
        ...

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when unknown or expired."""
        ...


class MemoryResponses:
    """Responses in this process: the newest `max_entries`, each for `ttl_s` seconds."""

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._items: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = (time.monotonic() + self.ttl_s, stored)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is None or entry[0] < time.monotonic():
            self._items.pop(response_id, None)
            return None
        return entry[1]
