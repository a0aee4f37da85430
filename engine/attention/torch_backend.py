"""Paged attention in pure torch (CPU and GPU): the reference path and pdserve's CPU fast path.

NOTE: per step, `prepare` turns the block tables into gather plans once; every layer reuses them.

    prefills  one SDPA call each. A whole prompt (no earlier context) attends its own k/v with
              is_causal. A chunk continuing a sequence gathers the sequence's cache blocks and
              uses a causal mask shifted by the earlier context: query t sits at position
              p = seq_len - q_len + t and sees keys 0..p. Chunks of at most SHORT_CHUNK tokens
              (speculative verification, small prompt chunks) are batched instead, as decodes
              are: one SDPA call for all of them (engine/attention/torch_chunks.py).
    decodes   one batched SDPA call for all of them. Whole blocks are gathered
              (index_select of [block_size, Hkv, D] rows, far cheaper than per-slot gathers), the
              tail past each sequence's length is masked out. GQA without copies: a decode has
              one query per head, so the G = H / Hkv query heads sharing a kv head become G
              "query positions" of that kv head:

        q [B, H, D] -> [B, Hkv, G, D]     k, v [B, Hkv, max_blocks * block_size, D]
        mask [B, 1, 1, max_blocks * block_size]: True where key position < seq_len

The masked tail of a sequence's last block is read too, so the cache must hold finite values
there: allocate it zeroed (engine/zero_pages.py on the CPU), not with torch.empty (0 * NaN is NaN
even under a mask).

Per-op overhead dominates a CPU decode step (~50 small ops a layer at ~2-5 us each), so the layer
path keeps its op count low, bit for bit what the plain ops compute: q and k rotated as one
[T, H + Hkv, D] view when they are adjacent slices of the fused qkv output (`rotate_joint`), K and
V of the decodes' blocks read by one index_select, and the mask handed to SDPA as the additive
float mask it would build from the bool one, once per step (`StepMemo`: per-step tables the first
layer builds and the others reuse).

An fp8 cache (kernels/kv_cache_fp8.py): the store writes k / k_scale and v / v_scale saturated to
e4m3; gathered blocks are de-quantized (fp32 x scale, then q's dtype) before SDPA (the stores and
gathers: engine/attention/torch_kv_cache.py). A whole prompt attends its own k/v as computed, as
vLLM's prefill does; later chunks and decodes read the fp8 cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_chunks import chunk_attention, chunk_plan, short_seqs
from engine.attention.torch_kv_cache import gather_blocks, gather_rows, store_kv
from engine.models.rotary import RopeInputs, rotate_qk
from kernels import cpu_attention
from kernels.kv_cache_fp8 import check_scales


@dataclass(frozen=True)
class PrefillPlan:
    start: int  # first new token of the sequence in the packed token axis
    end: int
    seq_len: int  # context length after this step (earlier context + new tokens)
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None: no earlier context
    mask: torch.Tensor | None  # [q_len, seq_len] bool, True = attend; None: plain causal


@dataclass(frozen=True)
class DecodePlan:
    start: int  # first decode token in the packed token axis
    block_ids: torch.Tensor  # [num_decodes * max_blocks] int64; table padding (block 0) masked
    mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend


class StepMemo:
    """Values a step's layers share, built by the first layer that asks (a key's `make()`),
    reused by the rest: they depend only on the step's plans, the rope tables and the cache's
    shape and dtype, all the same in every layer."""

    def __init__(self) -> None:
        self._values: dict[Any, Any] = {}

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = make()
        return value


@dataclass(frozen=True)
class TorchAttentionState:
    prefills: tuple[PrefillPlan | None, ...]  # None: a short chunk, batched (`short`)
    decode: DecodePlan | None
    short: tuple[int, ...] = ()  # prefill positions of the short chunks
    meta: AttentionMetadata | None = None  # the step's, for the short chunks' plan
    memo: StepMemo = field(default_factory=StepMemo)

    @property
    def decode_only(self) -> bool:
        return not self.prefills and self.decode is not None


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """`k_scale`, `v_scale`: an fp8 cache's per-tensor scales (1.0: uncalibrated)."""
        self.k_scale, self.v_scale = k_scale, v_scale

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build the step's gather plans into `meta.backend_state` (mutates `meta`); the short
        chunks' plan waits for the first layer (it needs the heads' grouping)."""
        short = short_seqs(meta)
        prefills = tuple(None if i in short else _prefill_plan(meta, i)
                         for i in range(meta.num_prefills))
        decode = _decode_plan(meta) if meta.num_decodes else None
        meta.backend_state = TorchAttentionState(prefills, decode, short, meta)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Rotate q and k by `rope` when given, write k/v into `kv_cache` at `meta.slot_mapping`
        (mutates it), then attend. Calls `prepare` first if the runner has not."""
        if not isinstance(meta.backend_state, TorchAttentionState):
            self.prepare(meta)
        state: TorchAttentionState = meta.backend_state
        if state.decode_only and not q.is_cuda:
            out = _c_decode(q, k, v, kv_cache, meta, scale, rope, state.memo)
            if out is not None:
                return out
        if rope is not None:
            q, k = rotate_joint(rope, q, k, state.memo)
        kv_scales = (self.k_scale, self.v_scale)
        check_scales("torch attention", kv_cache.dtype, *kv_scales)
        store_kv(k, v, kv_cache, meta.slot_mapping, *kv_scales)
        chunks = iter(_short_chunks(q, kv_cache, state, scale, kv_scales))
        outs = [next(chunks) if plan is None
                else _prefill_attention(q, k, v, kv_cache, plan, scale, kv_scales)
                for plan in state.prefills]
        if state.decode is not None:
            outs.append(_decode_attention(q, kv_cache, state.decode, scale, kv_scales, state.memo))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _c_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, rope: RopeInputs | None, memo: StepMemo,
) -> torch.Tensor | None:  # [T, H, D], or None: the torch ops serve this layer
    """A step of decodes only, on the CPU: the layer's rotation, stores and attention as one C
    call (kernels/cpu_attention.py) where the kernel builds here and takes the operands."""
    if rope is not None and rope.cos is None:
        return None
    cos, sin = (None, None) if rope is None else (rope.cos, rope.sin)
    if cpu_attention.library() is None or not cpu_attention.fits(q, k, v, kv_cache, cos):
        return None
    step = memo.get(("c_decode", id(rope)), lambda: cpu_attention.StepArgs(
        meta.slot_mapping, meta.block_tables, meta.seq_lens, cos, sin))
    return cpu_attention.paged_decode(q, k, v, kv_cache, step, scale)


def rotate_joint(
    rope: RopeInputs, q: torch.Tensor, k: torch.Tensor, memo: StepMemo
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H, D], [T, Hkv, D]
    """`rotate_qk(rope, q, k)`, bit for bit, in fewer ops: rotate_half(x) * sin is computed as
    (x's halves swapped) * (sin with its first half negated) (negation is exact), and when k's
    heads follow q's in memory (split views of the fused qkv output) both rotate as one
    [T, H + Hkv, D] view. The fused kernel's inputs (no cos/sin tables) go to `rotate_qk`."""
    if rope.cos is None:
        return rotate_qk(rope, q, k)
    _, cos, sin = memo.get(("rope", id(rope)), lambda: _signed_tables(rope))
    joint = _adjacent_heads(q, k)
    if joint is None:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    out = _rotate(joint, cos, sin)  # [T, H + Hkv, D]
    return out[:, : q.shape[1]], out[:, q.shape[1] :]


def _signed_tables(rope: RopeInputs) -> tuple[RopeInputs, torch.Tensor, torch.Tensor]:
    """(rope, cos [T, 1, D], sin [T, 1, D] with its first half negated); rope is kept so that
    its id, the memo's key, stays its own for the step."""
    half = rope.sin.shape[-1] // 2
    sin = rope.sin.clone()
    sin[:, :half].neg_()
    return rope, rope.cos[:, None, :], sin[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated: x * cos + (x2, x1) * (-sin1, sin2) (HF's rotate_half)."""
    t, heads, d = x.shape
    swapped = x.reshape(t, heads, 2, d // 2).flip(2).reshape(t, heads, d)
    return x * cos + swapped * signed_sin


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, Hkv, D] as one [T, H + Hkv, D] view when k's heads directly follow
    q's in one storage, rows equally strided (q, k of one qkv row); else None."""
    t, h, d = q.shape
    heads = h + k.shape[1]
    if (
        k.dtype != q.dtype
        or k.shape[0] != t
        or k.shape[2] != d
        or (t > 1 and k.stride(0) != q.stride(0))  # one row: its stride is arbitrary
        or q.stride()[1:] != (d, 1)
        or k.stride()[1:] != (d, 1)
        or k.data_ptr() != q.data_ptr() + h * d * q.element_size()
        or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    ):
        return None
    return q.as_strided((t, heads, d), (q.stride(0) if t > 1 else heads * d, d, 1))


def _prefill_plan(meta: AttentionMetadata, i: int) -> PrefillPlan:
    start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
    seq_len, q_len = meta.seq_lens_cpu[i], end - start
    if seq_len == q_len:
        return PrefillPlan(start, end, seq_len, None, None)
    device = meta.block_tables.device
    num_blocks = -(-seq_len // meta.block_size)
    block_ids = meta.block_tables[i, :num_blocks].long()
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)  # [q_len]
    key_pos = torch.arange(seq_len, device=device)  # [seq_len]
    mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
    return PrefillPlan(start, end, seq_len, block_ids, mask)


def _decode_plan(meta: AttentionMetadata) -> DecodePlan:
    first = meta.num_prefills
    max_len = max(meta.seq_lens_cpu[first:])
    max_blocks = -(-max_len // meta.block_size)
    device = meta.block_tables.device
    block_ids = meta.block_tables[first:, :max_blocks].long().reshape(-1)  # [B * max_blocks]
    key_pos = torch.arange(max_blocks * meta.block_size, device=device)  # [L]
    mask = key_pos[None, :] < meta.seq_lens[first:, None]  # [B, L]
    start = meta.query_start_loc_cpu[first]
    return DecodePlan(start, block_ids, mask[:, None, None, :])


def _prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    plan: PrefillPlan,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:  # [q_len, H, D]
    qs = q[plan.start : plan.end].transpose(0, 1)[None]  # [1, H, q_len, D]
    if plan.block_ids is None:  # whole prompt: its own k/v are the context
        ks = k[plan.start : plan.end].transpose(0, 1)[None]  # [1, Hkv, q_len, D]
        vs = v[plan.start : plan.end].transpose(0, 1)[None]
    else:
        k_ctx, v_ctx = gather_blocks(kv_cache, plan.block_ids, q.dtype, kv_scales)
        ks = k_ctx[: plan.seq_len].transpose(0, 1)[None]  # [1, Hkv, L, D]
        vs = v_ctx[: plan.seq_len].transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=plan.mask, is_causal=plan.mask is None, scale=scale, enable_gqa=True
    )  # [1, H, q_len, D]
    return out[0].transpose(0, 1)


def _decode_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    plan: DecodePlan,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    memo: StepMemo | None = None,
) -> torch.Tensor:  # [B, H, D]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[-2]
    batch = plan.mask.shape[0]
    memo = memo or StepMemo()
    rows = memo.get(("kv_rows", kv_cache.shape[1]), lambda: _kv_rows(plan, kv_cache.shape[1]))
    k_ctx, v_ctx = gather_rows(kv_cache, rows, q.dtype, kv_scales)  # [B * L, Hkv, D] each
    ks = k_ctx.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
    vs = v_ctx.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    qs = q[plan.start :].reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # the additive mask SDPA builds from the bool one (0 / -inf in q's dtype), built once
    mask = memo.get(("mask", q.dtype), lambda: _additive_mask(plan.mask, q.dtype))
    out = F.scaled_dot_product_attention(
        qs,  # [B, Hkv, G, D]
        ks,
        vs,
        attn_mask=mask,  # [B, 1, 1, L]
        scale=scale,
    )  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)


def _short_chunks(
    q: torch.Tensor, kv_cache: torch.Tensor, state: TorchAttentionState, scale: float,
    kv_scales: tuple[float, float],
) -> list[torch.Tensor]:  # each short chunk's [q_len, H, D], in order
    if not state.short:
        return []
    group = q.shape[1] // kv_cache.shape[-2]
    num_blocks, memo = kv_cache.shape[1], state.memo
    plan = memo.get(("chunks", group), lambda: chunk_plan(state.meta, state.short, group))
    rows = memo.get(("chunk_rows", num_blocks),
                    lambda: torch.cat((plan.block_ids, plan.block_ids + num_blocks)))
    mask = memo.get(("chunk_mask", q.dtype), lambda: _additive_mask(plan.sees, q.dtype))
    out = chunk_attention(q, kv_cache, plan, rows, mask, scale, kv_scales)  # [S, Q, H, D]
    starts = state.meta.query_start_loc_cpu
    return [out[j, : starts[i + 1] - starts[i]] for j, i in enumerate(state.short)]


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as SDPA's float form: 0 where True, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def _kv_rows(plan: DecodePlan, num_blocks: int) -> torch.Tensor:  # [2 * N] int64
    """The decodes' blocks as rows of the cache viewed [2 * num_blocks, ...]: K's, then V's."""
    return torch.cat((plan.block_ids, plan.block_ids + num_blocks))
