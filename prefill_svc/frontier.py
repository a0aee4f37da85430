"""Which of a request's KV cells (one layer x one block) are final and not yet sent, as slabs.

NOTE: per layer, both the final blocks and the sent blocks of a request are prefixes of its
block list: a layer's blocks become final in order, chunk after chunk, earlier layers first
(within one run of the request `ready` never grows with the layer index); every slab starts at
its layers' first unsent block, so `sent` stays a prefix. A slab is a rectangle of layers that
share one sent prefix, up to the blocks all of them have final:

    layer   0  1  2  3  4  5 ..        step 2 is past layer 3: its 3 blocks are final there
    ready   6  6  6  6  3  3 ..
    sent    3  3  3  3  3  3 ..        -> slab layers [0, 4) x blocks [3, 6)

cut to at most `max_bytes` (whole layers when a layer's blocks fit, else blocks of one layer in
pieces of even size: `even_piece`).
A rectangle that could still grow by a layer within `max_bytes` is left to grow (a full one
further down the layers goes first) unless the caller flushes. A preemption restarts the
request (`restart`): nothing is final until computed again; what was sent stays sent (it was
final when it was read).
"""

from __future__ import annotations

from engine.kv_transfer import KVLayout, SlabRange, even_piece


class SlabFrontier:
    def __init__(self, layout: KVLayout, num_blocks: int, max_bytes: int, skip_blocks: int = 0):
        """`skip_blocks`: the receiver holds the first blocks already; they count as sent."""
        if not 0 <= skip_blocks <= num_blocks:
            raise ValueError(f"skip_blocks {skip_blocks} out of range [0, {num_blocks}]")
        self.num_layers = layout.num_layers
        self.num_blocks = num_blocks
        self.cell_bytes = layout.cell_bytes()
        self.max_bytes = max_bytes
        self.ready = [0] * self.num_layers  # leading final blocks, per layer
        self.sent = [skip_blocks] * self.num_layers  # leading sent blocks, per layer

    def skip(self, skip_blocks: int) -> None:
        """The receiver holds the first `skip_blocks` blocks (told before anything was sent)."""
        if not 0 <= skip_blocks <= self.num_blocks:
            raise ValueError(f"skip_blocks {skip_blocks} out of range [0, {self.num_blocks}]")
        if any(self.sent):
            raise RuntimeError("blocks to skip named after a slab was sent")
        self.sent = [skip_blocks] * self.num_layers

    @property
    def complete(self) -> bool:
        """Every layer x block sent."""
        return all(n == self.num_blocks for n in self.sent)

    def advance(self, num_layers: int, num_blocks: int) -> None:
        """Layers [0, num_layers) have their first `num_blocks` blocks final."""
        num_blocks = min(num_blocks, self.num_blocks)
        for layer in range(num_layers):
            self.ready[layer] = max(self.ready[layer], num_blocks)

    def restart(self) -> None:
        self.ready = [0] * self.num_layers

    def next(self, flush: bool) -> SlabRange | None:
        """The next slab to send: the first full one, or with `flush` the first; None if none."""
        l0 = 0
        while l0 < self.num_layers:
            if self.ready[l0] <= self.sent[l0]:
                l0 += 1
                continue
            slab, full = self._rectangle(l0)
            if full or flush:
                return slab
            l0 = slab[1]
        return None

    def _rectangle(self, l0: int) -> tuple[SlabRange, bool]:
        """The slab from layer `l0`'s first unsent block, and whether it is full."""
        b0, b1, l1 = self.sent[l0], self.ready[l0], l0 + 1
        while l1 < self.num_layers and self.sent[l1] == b0 and self.ready[l1] > b0:
            b1 = min(b1, self.ready[l1])
            l1 += 1
        per_layer = (b1 - b0) * self.cell_bytes
        if per_layer > self.max_bytes:  # blocks of one layer
            piece = even_piece(b1 - b0, self.max_bytes // self.cell_bytes)
            return (l0, l0 + 1, b0, b0 + piece), True
        fit = max(1, self.max_bytes // per_layer)
        if fit < l1 - l0:
            return (l0, l0 + fit, b0, b1), True
        return (l0, l1, b0, b1), (l1 - l0 + 1) * per_layer > self.max_bytes

    def mark_sent(self, slab: SlabRange) -> None:
        l0, l1, b0, b1 = slab
        for layer in range(l0, l1):
            assert self.sent[layer] == b0, "slabs are sent in the order `next` gives them"
            self.sent[layer] = b1
