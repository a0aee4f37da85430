"""Paged attention on the GPU through pdserve's Triton kernels (kernels/).

NOTE: per layer, one launch that rotates q/k and stores K/V (kernels.rope_store), then at most
two attention launches over the packed batch:

    new tokens  | prefill chunks (any length, any earlier context) | decodes (one token each) |
                  kernels.prefill_attention                          kernels.paged_decode_attention
                  (causal over the paged cache)                      (flash-decoding splits)

Both read every key from the paged cache, where the store has just put the new tokens' K/V. No
host data is read inside `forward` after the first layer: the step's split count and longest
prefill chunk are computed once (from the metadata's Python-side lists) and kept in
`meta.backend_state`, so a decode step captured in a CUDA graph replays for any context length.
An fp8 cache (kernels/kv_cache_fp8.py): the store quantizes, both attention kernels de-quantize
in registers, with the backend's per-tensor k_scale and v_scale.
With `merged_decode`, decodes split over the context merge their splits inside the one decode
kernel (kernels/paged_decode_attention_merged.py) instead of a second reduce launch. Off by
default: on an H100 it measured faster only where a sequence fits one 128-token tile
(docs/benchmarks.md, batch-1 decode).
On Hopper and later the decode kernels start by programmatic dependent launch (each may launch
while the kernel ahead finishes, as the decode GEMVs around them do: kernels/gemv.py);
PDSERVE_ATTN_PDL=0 launches them plainly (comparisons).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.models.rotary import RopeInputs, rotate_qk
from kernels.kv_store import store_kv
from kernels.paged_decode_attention import default_num_splits, paged_decode_attention
from kernels.paged_decode_attention_merged import paged_decode_attention_merged
from kernels.prefill_attention import prefill_attention
from kernels.rope_store import rope_and_store

PDL = os.environ.get("PDSERVE_ATTN_PDL", "1") != "0"


@dataclass(frozen=True)
class TritonAttentionState:
    num_splits: int  # context splits of the decode kernel
    max_prefill_query_len: int  # longest prefill chunk: the prefill kernel's grid
    decode_seq_lens: torch.Tensor  # the decodes' lengths, 16-byte aligned


class TritonAttentionBackend:
    name = "triton"
    stores_fused_rope = True  # `forward(..., stored=True)`: q/k/v rotated and stored already

    def __init__(self, num_sms: int | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0, merged_decode: bool = False) -> None:
        """`k_scale`, `v_scale`: an fp8 cache's per-tensor scales (1.0: uncalibrated);
        `merged_decode`: one decode launch for any split count (False: attention + reduce)."""
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties().multi_processor_count \
                if torch.cuda.is_available() else 1
        self.num_sms = num_sms
        self.k_scale, self.v_scale = k_scale, v_scale
        self.merged_decode = merged_decode
        self._pdl: dict[torch.device, bool] = {}  # per device: launch the decode kernels by PDL

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to precompute before the kv head count is known: `forward` fills the state
        on the first layer."""
        meta.backend_state = None

    def _state(self, meta: AttentionMetadata, num_kv_heads: int) -> TritonAttentionState:
        starts = meta.query_start_loc_cpu
        longest = max((starts[i + 1] - starts[i] for i in range(meta.num_prefills)), default=0)
        splits = default_num_splits(max(meta.num_decodes, 1), num_kv_heads, meta.max_seq_len,
                                    self.num_sms)
        # Triton specialises on pointer alignment: a view starting at an odd row would compile
        # another variant of the decode kernel for some mixes of prefills and decodes.
        lens = meta.seq_lens[meta.num_prefills:]
        if meta.num_prefills % 4:
            lens = lens.clone()
        return TritonAttentionState(splits, longest, lens)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        rope: RopeInputs | None = None,
        stored: bool = False,
    ) -> torch.Tensor:  # [T, H, D]
        """Rotate q and k by `rope` when given, write k/v into `kv_cache` at `meta.slot_mapping`
        (mutates it), then attend. With the fused rotary's inputs (`rope.cache`), rotation and
        store are one kernel, which rotates q in place and k only into the cache. `stored`: the
        caller's q/k/v GEMV did both (engine/models/fused_qkv_rope.py): attend only."""
        if meta.backend_state is None:
            meta.backend_state = self._state(meta, kv_cache.shape[-2])
        state: TritonAttentionState = meta.backend_state
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        scales = (self.k_scale, self.v_scale)  # an fp8 cache's
        if stored:
            pass
        elif rope is not None and rope.cache is not None:
            rope_and_store(rope.positions, q, k, v, k_cache, v_cache, meta.slot_mapping,
                           rope.cache, *scales)
        else:
            if rope is not None:
                q, k = rotate_qk(rope, q, k)
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
        kv_scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_prefills, split = meta.num_prefills, meta.num_prefill_tokens
        if num_prefills:
            prefill_attention(
                q[:split], k_cache, v_cache, meta.block_tables[:num_prefills],
                meta.query_start_loc[: num_prefills + 1], meta.seq_lens[:num_prefills], scale,
                state.max_prefill_query_len, out=out[:split], **kv_scales,
            )
        if meta.num_decodes:
            # one split: the two paths are the same single launch (the plain one ~1% faster)
            merged = self.merged_decode and state.num_splits > 1
            args = (q[split:], k_cache, v_cache, meta.block_tables[num_prefills:],
                    state.decode_seq_lens, scale)
            if merged:
                paged_decode_attention_merged(*args, num_splits=state.num_splits,
                                              out=out[split:], **kv_scales)
            else:
                paged_decode_attention(*args, num_splits=state.num_splits, out=out[split:],
                                       pdl=self._uses_pdl(q.device), **kv_scales)
        return out

    def _uses_pdl(self, device: torch.device) -> bool:
        """Whether the decode kernels launch by PDL on `device`: CUDA of compute capability 9
        (Hopper) or later, unless PDSERVE_ATTN_PDL=0."""
        pdl = self._pdl.get(device)
        if pdl is None:
            pdl = self._pdl[device] = (PDL and device.type == "cuda"
                                       and torch.cuda.get_device_capability(device)[0] >= 9)
        return pdl
