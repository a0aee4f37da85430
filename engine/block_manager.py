"""Paged KV bookkeeping: which physical blocks each request owns, shared by reference count.

Torch-free. Block ids are integers into the KV cache tensors the model runner owns.

Automatic prefix caching: a *full*, *computed* block is registered under a hash chained over every
token before it (`hash(parent_hash, block tokens)`), so equal prefixes map to equal hashes. A new
request first looks up its longest registered prefix and reuses those blocks (ref count + 1)
instead of recomputing them. A freed block keeps its hash and content while it waits in the free
queue; it leaves the cache only when it is evicted to serve a new allocation.

Free queue (LRU): evictions take from the front. A freed request returns its blocks tail first,
so its last blocks (the least shared) go before its first ones; unregistered blocks hold nothing
reusable and go to the very front.

    front (evict next) ◀── [unhashed …][req A tail … req A head][req B tail … head] ──▶ back
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from engine.kv_events import KVEventBatch, KVEvents
from engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chain hash of one full block: stable across processes (prefill and decode workers)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\0")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))  # 4-byte little-endian ids
    return h.digest()


def chain_root(lora_name: str | None) -> bytes | None:
    """The parent of a request's first block: None for the base model, a hash of the adapter's
    name under a LoRA adapter, so that equal tokens under different adapters (whose K/V
    differ) never share a block. The name, as vLLM keys it: stable across workers."""
    if lora_name is None:
        return None
    return hashlib.blake2b(b"lora\0" + lora_name.encode(), digest_size=16).digest()


def prefix_hashes(
    token_ids: list[int], block_size: int, lora_name: str | None = None
) -> list[bytes]:
    """The chain hashes of every full block of `token_ids` (a partial last block has none):
    what a worker's prefix cache registers for them. The gateway's router uses the same."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else chain_root(lora_name),
                                 token_ids[start:start + block_size]))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.kv_events = KVEvents()  # registrations and evictions, for KV-aware routing
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now, including cached blocks no request holds."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held by requests or waiting in the free queue."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request, all_tokens: bool = False) -> list[int]:
        """Longest registered prefix of `req`, as block ids. Counts the lookup; takes nothing.

        At most `(num_tokens - 1) // block_size` blocks: the last token is always recomputed so
        the step that schedules it produces logits to sample from. With `all_tokens` (a decode
        worker reserving for KV computed elsewhere: no logits needed here) every full block of
        `req`'s tokens may hit.
        """
        if not self.enable_prefix_caching:
            return []
        if req.sampling_params.prompt_logprobs is not None and not all_tokens:
            return []  # prompt logprobs need every prompt position computed
        limit = (req.num_tokens - (0 if all_tokens else 1)) // self.block_size
        self._extend_hashes(req, limit)
        hits: list[int] = []
        for block_hash in req.block_hashes[:limit]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    # ---- mutations -----------------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens after its computed ones.

        `computed_blocks` (first admission only): already-computed blocks to share — prefix cache
        hits or a sibling's prompt blocks — appended to the block table with ref count + 1; the
        caller advances `req.num_computed_tokens` past them. Returns False, changing nothing, if
        the free blocks do not suffice.
        """
        if not computed_blocks:  # the common case (every decode step): maybe no block at all
            room = len(req.block_ids) * self.block_size - req.num_computed_tokens
            if num_new_tokens <= room:
                return True
        computed_blocks = computed_blocks or []
        num_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_tokens + num_new_tokens)
        num_new_blocks = need - len(req.block_ids) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > len(self._free) - reclaimed:
            return False
        for block_id in computed_blocks:
            self._hold(block_id)
        req.block_ids.extend(computed_blocks)
        req.block_table_version += 1
        if computed_blocks and self.enable_prefix_caching:
            req.num_registered_blocks = len(req.block_ids)
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.blocks[block_id].ref_count = 1
            req.block_ids.append(block_id)
        return True

    def rollback_slots(self, req: Request, num_tokens: int) -> None:
        """Speculative decoding: keep only the blocks holding `req`'s first `num_tokens` slots
        (its computed tokens once rejected drafts are rolled back) and free the tail blocks,
        which held only rejected drafts' K/V; they go to the front of the free queue.

        A rejected draft's block is never registered in the prefix cache: only blocks full of
        computed tokens that are the request's own (appended) are, and the slots past
        `num_tokens` in the kept last block are written again before anything reads them.
        ValueError, changing nothing, if a block to free is shared or registered.
        """
        keep = self.blocks_needed(num_tokens)
        tail = req.block_ids[keep:]
        for block_id in tail:
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.block_hash is not None:
                raise ValueError(f"block {block_id} of {req.request_id!r} is shared or cached: "
                                 "it holds no rejected draft")
        for block_id in reversed(tail):
            self.blocks[block_id].ref_count = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        del req.block_ids[keep:]
        req.block_table_version += 1

    def cache_full_blocks(self, req: Request) -> None:
        """Register `req`'s newly full and computed blocks in the prefix cache.

        A block whose content is already registered under another id (two requests computed the
        same prefix at once) stays unregistered; it is freed like any private block.
        """
        if not self.enable_prefix_caching \
                or req.num_computed_tokens // self.block_size <= req.num_registered_blocks:
            return  # the common case, twice a step per request: no block filled since
        # tokens sampled but not yet appended have no id to hash yet
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= req.num_registered_blocks:
            return
        self._extend_hashes(req, num_full)
        for i in range(req.num_registered_blocks, num_full):
            block = self.blocks[req.block_ids[i]]
            block_hash = req.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
                self.kv_events.stored(block_hash)
        req.num_registered_blocks = num_full

    def free(self, req: Request) -> None:
        """Drop `req`'s hold on its blocks (tail first) and clear its block table."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
        req.block_ids = []
        req.block_table_version += 1
        req.num_registered_blocks = 0

    def cached_hashes(self) -> list[bytes]:
        """Every hash registered in the prefix cache now."""
        return list(self._cached)

    def drain_kv_events(self) -> KVEventBatch:
        """What the prefix cache gained and lost since the last call (engine/kv_events.py)."""
        return self.kv_events.drain(self.cached_hashes())

    def reset_prefix_cache(self) -> None:
        """Forget every registered block that no request holds."""
        for block_id in self._free:
            self._evict(block_id)

    # ---- internals -----------------------------------------------------------------------
    def _hold(self, block_id: int) -> None:
        """One more holder of a computed block; a cached block leaves the free queue, keeping
        its hash."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                self.kv_events.removed(block.block_hash)
            block.block_hash = None

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[i - 1] if i else chain_root(req.lora_name)
            req.block_hashes.append(hash_block(parent, req.token_ids_slice(i * bs, (i + 1) * bs)))
