"""Stored Responses API responses in Redis, shared by every gateway of a cluster: one JSON
string per response under ``{p}:response:{id}`` (``state.Keys``), expiring after ``ttl_s``.
What is stored is gateway/responses/store.py's StoredResponse."""

from __future__ import annotations

import json

from redis.asyncio import Redis

from gateway.responses.store import StoredResponse
from pdserve.cluster.state import DEFAULT_PREFIX, Keys, wrap_redis_errors


class RedisResponses:
    def __init__(self, client: Redis, prefix: str = DEFAULT_PREFIX, ttl_s: int = 3600) -> None:
        self.client, self.keys, self.ttl_s = client, Keys(prefix), ttl_s

    @wrap_redis_errors
    async def put(self, response_id: str, stored: StoredResponse) -> None:
        value = json.dumps({"response": stored.response, "messages": stored.messages})
        await self.client.set(self.keys.response(response_id), value, ex=self.ttl_s)

    @wrap_redis_errors
    async def get(self, response_id: str) -> StoredResponse | None:
        value = await self.client.get(self.keys.response(response_id))
        if value is None:
            return None
        data = json.loads(value)
        return StoredResponse(data["response"], data["messages"])
