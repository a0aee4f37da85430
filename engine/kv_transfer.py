"""Moving a request's KV blocks between engines as raw bytes (no network code here).

The transfer unit is a slab: layers [l0, l1) x the request's blocks [b0, b1), serialized as the
raw bytes of a tensor shaped [l1 - l0, 2 (K, V), b1 - b0, block_size, num_kv_heads, head_dim].
Block indices are positions in the request's block list, never physical ids: each side maps
them through its own block table.

    sender cache (layer l)  [2, num_blocks, bs, Hkv, D] --index_select(block ids)--> slab rows
    receiver cache (layer l) <--index_copy_(its own block ids)-- slab rows

The receiver checks the sender's `KVLayout` before accepting anything, then checks every slab's
range and byte count, and that the slabs cover every layer x block exactly once. The layout's
dtype is the cache's (the model's, or "float8_e4m3fn" with `kv_cache_dtype="fp8"`: half the
bytes of bf16 move); a push of another dtype is refused, never converted. Copies of a 1-byte
cache go through uint8 views (kernels/kv_cache_fp8.py: torch lacks some fp8 copy kernels).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.distributed.kv_shards import ShardedKVLayer
from kernels.kv_cache_fp8 import KV_FP8, as_bytes, index_copy_kv

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": KV_FP8}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "float8_e4m3fn" (an fp8 KV cache)
    block_size: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def cell_bytes(self) -> int:
        """Bytes of one layer x one block (K and V)."""
        # (dtype.itemsize, not a tensor's element_size: making a tensor releases the GIL and
        # then waits for it again, behind the engine thread, on every push)
        itemsize = self.torch_dtype.itemsize
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def check_compatible(self, sender: KVLayout) -> None:
        """ValueError naming every field where `sender`'s layout differs from this one."""
        diffs = [
            f"{name}: sender {getattr(sender, name)} != receiver {getattr(self, name)}"
            for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
            if getattr(sender, name) != getattr(self, name)
        ]
        if sender.dtype != self.dtype:  # the likeliest cause first
            diffs.append("prefill and decode workers need the same --dtype and "
                         "--kv-cache-dtype")
        if diffs:
            raise ValueError("KV layout mismatch: " + "; ".join(diffs))


def read_blocks(cache: torch.Tensor | ShardedKVLayer, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [2, len(ids), bs, Hkv, D] <- blocks `ids` of one layer's cache (or every rank's)."""
    if isinstance(cache, ShardedKVLayer):
        cache.read(ids, out)
    else:
        torch.index_select(as_bytes(cache), 1, ids, out=as_bytes(out))


def write_blocks(
    cache: torch.Tensor | ShardedKVLayer, ids: torch.Tensor, src: torch.Tensor
) -> None:
    """Blocks `ids` of one layer's cache (or every rank's) <- src [2, len(ids), bs, Hkv, D]."""
    if isinstance(cache, ShardedKVLayer):
        cache.write(ids, src)
    else:
        index_copy_kv(cache, 1, ids, src)


def layout_of(kv_caches: list[torch.Tensor] | list[ShardedKVLayer]) -> KVLayout:
    _, _, block_size, num_kv_heads, head_dim = kv_caches[0].shape
    dtype = next(name for name, dt in _DTYPES.items() if dt == kv_caches[0].dtype)
    return KVLayout(len(kv_caches), num_kv_heads, head_dim, dtype, block_size)


def pool_layout(pool: torch.Tensor) -> KVLayout:
    """The layout of a whole KV pool [L, 2, num_blocks, block_size, Hkv, D] (one allocation
    whose per-layer views are the engine's `kv_caches`)."""
    return layout_of(list(pool.unbind(0)))


@dataclass(frozen=True)
class KVSlab:
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    data: bytes | memoryview  # a view of the message it came in, on the receiving side


SlabRange = tuple[int, int, int, int]  # layer_start, layer_end, block_start, block_end


def plan_slabs(layout: KVLayout, num_blocks: int, max_bytes: int) -> list[SlabRange]:
    """(l0, l1, b0, b1) ranges covering layers x blocks in slabs of at most `max_bytes` (or one
    cell when a cell is larger), whole layers first, for KV computed already. (A prefill worker
    cuts its slabs as the KV is computed, prefill_svc/frontier.py: the same ranges when all of
    it is final at once.)"""
    cell = layout.cell_bytes()
    per_layer = cell * num_blocks
    if per_layer <= max_bytes:
        group = max(1, max_bytes // per_layer)
        return [
            (l0, min(l0 + group, layout.num_layers), 0, num_blocks)
            for l0 in range(0, layout.num_layers, group)
        ]
    slabs = []
    for layer in range(layout.num_layers):
        b0 = 0
        while b0 < num_blocks:
            b1 = b0 + even_piece(num_blocks - b0, max_bytes // cell)
            slabs.append((layer, layer + 1, b0, b1))
            b0 = b1
    return slabs


def even_piece(num_blocks: int, max_blocks: int) -> int:
    """The first of the fewest pieces of at most `max_blocks` (at least 1) that `num_blocks`
    split into, as even as they go (7 by 3: 3, then 2 and 2). Not the largest pieces and a
    remainder: gRPC moved a layer's 4 MiB slabs followed by its 0.6 MiB rest at about half the
    bytes per second of even ~2.9 MiB messages (raw grpcio, loopback, 2026-12-05)."""
    max_blocks = max(1, max_blocks)
    pieces = -(-num_blocks // max_blocks)
    return -(-num_blocks // pieces)


def read_slabs(
    kv_caches: list[torch.Tensor], block_ids: list[int], max_bytes: int = 4 << 20,
    skip_blocks: int = 0,
) -> Iterator[KVSlab]:
    """Serialize a request's blocks (in `block_ids` order) after the first `skip_blocks` (the
    receiver holds those), slab by slab. Reads the cache."""
    layout = layout_of(kv_caches)
    device = kv_caches[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    for l0, l1, b0, b1 in plan_slabs(layout, len(block_ids) - skip_blocks, max_bytes):
        b0, b1 = b0 + skip_blocks, b1 + skip_blocks
        sel = ids[b0:b1]
        slab = torch.empty((l1 - l0, 2, b1 - b0, *kv_caches[0].shape[2:]),
                           dtype=kv_caches[0].dtype, device=device)
        for i, layer in enumerate(range(l0, l1)):
            read_blocks(kv_caches[layer], sel, slab[i])
        yield KVSlab(l0, l1, b0, b1, _to_bytes(slab))


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    return t.view(torch.uint8).numpy().tobytes()


class KVSlabWriter:
    """Receives one request's slabs into its reserved blocks; knows when all have arrived."""

    def __init__(
        self, kv_caches: list[torch.Tensor] | list[ShardedKVLayer] | None, block_ids: list[int],
        present: int = 0, layout: KVLayout | None = None,
    ):
        """`present`: the first blocks hold their KV already (the receiver's prefix cache had
        them): no slab may cover them, and they count as arrived. `kv_caches` None (with the
        `layout`): a data plane's push, whose sender writes the blocks (`mark_written` only)."""
        if not 0 <= present <= len(block_ids):
            raise ValueError(f"present blocks {present} out of range [0, {len(block_ids)}]")
        self.kv_caches = kv_caches
        self.layout = layout or layout_of(kv_caches)
        self.block_ids = None if kv_caches is None else torch.tensor(
            block_ids, dtype=torch.long, device=kv_caches[0].device)
        self.num_blocks = len(block_ids)
        self._seen = torch.zeros(self.layout.num_layers, self.num_blocks, dtype=torch.bool)
        self._seen[:, :present] = True
        self._missing = self.layout.num_layers * (self.num_blocks - present)  # cells to come
        self.bytes_received = 0

    @property
    def complete(self) -> bool:
        return self._missing == 0

    def write(self, slab: KVSlab) -> None:
        """Check `slab` (range, size, no overlap) and copy it into the cache (mutates it).
        ValueError, writing nothing, if any check fails."""
        l0, l1, b0, b1 = slab.layer_start, slab.layer_end, slab.block_start, slab.block_end
        if self.kv_caches is None or self.block_ids is None:
            raise ValueError("KV slab bytes on a push whose sender writes the blocks itself")
        self._check_range(l0, l1, b0, b1)
        expected = (l1 - l0) * (b1 - b0) * self.layout.cell_bytes()
        if len(slab.data) != expected:
            raise ValueError(f"KV slab holds {len(slab.data)} bytes, expected {expected}")
        lay = self.layout
        with warnings.catch_warnings():  # the bytes are only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(slab.data, dtype=torch.uint8)
        slab_t = raw.view(lay.torch_dtype).view(
            l1 - l0, 2, b1 - b0, lay.block_size, lay.num_kv_heads, lay.head_dim
        ).to(self.kv_caches[0].device)
        ids = self.block_ids[b0:b1]
        for i, layer in enumerate(range(l0, l1)):
            write_blocks(self.kv_caches[layer], ids, slab_t[i])
        self._mark(l0, l1, b0, b1)

    def mark_written(self, slab: SlabRange) -> None:
        """The sender wrote these cells into the reserved blocks itself (a data plane): check
        the range (no overlap) and count them. ValueError if a check fails."""
        self._check_range(*slab)
        self._mark(*slab)

    def _check_range(self, l0: int, l1: int, b0: int, b1: int) -> None:
        if not (0 <= l0 < l1 <= self.layout.num_layers and 0 <= b0 < b1 <= self.num_blocks):
            raise ValueError(f"KV slab range layers [{l0}, {l1}) x blocks [{b0}, {b1}) is invalid")
        if self._seen[l0:l1, b0:b1].any():
            raise ValueError(f"KV slab layers [{l0}, {l1}) x blocks [{b0}, {b1}) overlaps another")

    def _mark(self, l0: int, l1: int, b0: int, b1: int) -> None:
        self._seen[l0:l1, b0:b1] = True
        self._missing -= (l1 - l0) * (b1 - b0)
        self.bytes_received += (l1 - l0) * (b1 - b0) * self.layout.cell_bytes()
