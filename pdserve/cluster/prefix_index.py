"""Which prefix blocks each worker's KV cache holds, in Redis, for KV-aware routing.

A worker publishes its prefix cache's events (engine/kv_events.py) after each heartbeat into a
set of hex block hashes under ``{p}:prefix:{worker_id}``, with the registry entry's TTL: a dead
worker's set goes with its entry; a restarted one replaces it (its first batch is a reset). A
gateway asks, for a request's chain of block hashes, how many leading blocks each candidate
holds (one SMISMEMBER per worker, pipelined): a gateway that restarts reads the same sets.
"""

from __future__ import annotations

from redis.asyncio import Redis

from engine.kv_events import KVEventBatch
from pdserve.cluster.state import DEFAULT_PREFIX, Keys, wrap_redis_errors

_CHUNK = 2048  # hashes per SADD / SREM


class PrefixIndex:
    def __init__(self, client: Redis, prefix: str = DEFAULT_PREFIX, ttl_s: float = 5.0) -> None:
        self.client, self.keys, self.ttl_s = client, Keys(prefix), ttl_s

    @wrap_redis_errors
    async def publish(self, worker_id: str, batch: KVEventBatch) -> None:
        """Apply one batch of a worker's events (a reset replaces the whole set)."""
        key = self.keys.prefix_blocks(worker_id)
        pipe = self.client.pipeline(transaction=True)
        if batch.reset:
            pipe.delete(key)
        for hashes, op in ((batch.removed, pipe.srem), (batch.stored, pipe.sadd)):
            for i in range(0, len(hashes), _CHUNK):
                op(key, *(h.hex() for h in hashes[i:i + _CHUNK]))
        pipe.pexpire(key, max(1, int(self.ttl_s * 1000)))
        await pipe.execute()

    @wrap_redis_errors
    async def leading_hits(self, worker_ids: list[str], hashes: list[bytes]) -> dict[str, int]:
        """Per worker, how many of `hashes` (a request's chain, in order) it holds from the
        first on. Read only."""
        if not hashes or not worker_ids:
            return dict.fromkeys(worker_ids, 0)
        members = [h.hex() for h in hashes]
        pipe = self.client.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.smismember(self.keys.prefix_blocks(worker_id), members)
        found = await pipe.execute()
        return {w: _leading(flags) for w, flags in zip(worker_ids, found)}

    async def refresh(self, worker_id: str) -> None:
        """Keep the set alive without changes (a heartbeat with no new events)."""
        await self.client.pexpire(self.keys.prefix_blocks(worker_id),
                                  max(1, int(self.ttl_s * 1000)))


def _leading(flags: list[int]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)
