"""What a worker's prefix cache gained and lost since it was last asked: the block hashes it
registered (`stored`) and evicted (`removed`), for the cluster's KV-aware routing
(pdserve/cluster/prefix_index.py publishes them). Torch-free.

The pending lists are bounded: past `max_pending` events (nobody drains them) they are dropped
and the next `drain` says `reset`: the reader must then take the full set of cached hashes
instead (`BlockManager.cached_hashes`). A fresh worker starts with `reset` too, so a registry
entry left by an earlier process under the same id is replaced, not extended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVEventBatch:
    reset: bool  # forget everything published before; `stored` is then the full set
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class KVEvents:
    def __init__(self, max_pending: int = 1 << 16) -> None:
        self.max_pending = max_pending
        self._stored: dict[bytes, None] = {}
        self._removed: dict[bytes, None] = {}
        self._reset = True

    def stored(self, block_hash: bytes) -> None:
        self._removed.pop(block_hash, None)
        self._stored[block_hash] = None
        self._bound()

    def removed(self, block_hash: bytes) -> None:
        # the last event of a hash wins: `stored` and `removed` stay disjoint
        self._stored.pop(block_hash, None)
        self._removed[block_hash] = None
        self._bound()

    def drain(self, cached: list[bytes]) -> KVEventBatch:
        """The events since the last drain; after a reset, `cached` (every hash held now)."""
        if self._reset:
            batch = KVEventBatch(True, list(cached))
        else:
            batch = KVEventBatch(False, list(self._stored), list(self._removed))
        self._stored, self._removed, self._reset = {}, {}, False
        return batch

    def _bound(self) -> None:
        if len(self._stored) + len(self._removed) > self.max_pending:
            self._stored, self._removed, self._reset = {}, {}, True


def prefix_events(block_manager: Any, full: bool) -> KVEventBatch:
    """A block manager's events since the last call; with `full`, every cached hash."""
    batch = block_manager.drain_kv_events()
    return KVEventBatch(True, block_manager.cached_hashes()) if full else batch
