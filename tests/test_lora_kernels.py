"""The batched LoRA kernels (kernels/lora.py) against their torch reference, and the reference
against a naive per-token loop; on CPU through Triton's interpreter (tiny shapes), on a GPU the
compiled kernels with the tiles lora_apply picks."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kernels import lora
from kernels.lora import (
    FUSED_MAX_T,
    INTERPRET_CONFIGS,
    INTERPRET_FUSED,
    FusedConfig,
    LoRAConfig,
    choose_config,
    lora_apply,
    lora_apply_ref,
    lora_expand,
    lora_shrink,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the kernels need triton")
# both slot groupings (one program walks every slot of its tile, or a grid axis per slot) of
# two launches, and of one fused launch with K whole or split in two (summed by the last part)
PATHS = {"walk": INTERPRET_CONFIGS[False], "by-slot": INTERPRET_CONFIGS[True],
         "fused-walk": INTERPRET_FUSED[1, False], "fused-by-slot": INTERPRET_FUSED[1, True],
         "fused-split-walk": INTERPRET_FUSED[2, False],
         "fused-split-by-slot": INTERPRET_FUSED[2, True]}

# name -> (in features, slice_offsets, rank R, slots S, per-token slots); -1: no adapter
CASES = {
    # GQA qkv (q 32, k 8, v 8), 21 tokens (two 16-row tiles, the second ragged), mixed slots
    "qkv-mixed": (40, (0, 32, 40, 48), 8, 3,
                  [2, 0, -1, 1, 2, 2, 0, -1, 1, 1, 0, 2, -1, 0, 0, 1, 2, 1, -1, 0, 2]),
    "one-token": (24, (0, 40), 4, 4, [3]),  # o_proj-like: one slice; R 4 -> padded to 16
    # gate_up in contiguous runs (prefill: an adapter per sequence, one base-model sequence)
    "gate-up-runs": (32, (0, 20, 40), 16, 2, [1] * 9 + [-1] * 3 + [0] * 5),
    "all-base": (24, (0, 16, 28), 8, 2, [-1] * 5),
    # decode: one adapter for the whole batch (one pass per tile), K 40 split 2 -> 32 + 8
    "one-slot": (40, (0, 24, 40), 8, 3, [1] * 18),
}


def make_case(name: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    """x, lora_a, lora_b, slots, y, offsets on DEVICE."""
    k, offsets, r, s, slot_list = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    n_slices, n, t = len(offsets) - 1, offsets[-1], len(slot_list)
    x = torch.randn(t, k, generator=gen)
    a = torch.randn(s, n_slices * r, k, generator=gen) * 0.3
    b = torch.randn(s, n, r, generator=gen) * 0.3
    y = torch.randn(t, n, generator=gen)
    slots = torch.tensor(slot_list, dtype=torch.int32)
    x, a, b, y = (v.to(DEVICE, dtype) for v in (x, a, b, y))
    return x, a, b, slots.to(DEVICE), y, offsets


def naive(x, a, b, slots, y, offsets, rank: int | None = None) -> torch.Tensor:
    """Token by token, slice by slice, in fp32: y + B (A x)."""
    out = y.float().clone()
    r = b.shape[2]
    rank = rank or r
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            h = a[s, i * r:i * r + rank].float() @ x[t].float()
            out[t, lo:hi] += b[s, lo:hi, :rank].float() @ h
    return out


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_a_naive_loop(case: str) -> None:
    x, a, b, slots, y, offsets = make_case(case, torch.float32)
    expect = naive(x, a, b, slots, y, offsets)
    lora_apply_ref(x, a, b, slots, y, offsets)
    torch.testing.assert_close(y, expect, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case: str, path: str, dtype: torch.dtype) -> None:
    x, a, b, slots, y, offsets = make_case(case, dtype, seed=1)
    y0, ref = y.clone(), y.clone()
    lora_apply(x, a, b, slots, y, offsets, config=PATHS[path])
    lora_apply_ref(x, a, b, slots, ref, offsets)
    torch.testing.assert_close(y.float(), ref.float(), **tol(dtype))
    base = slots < 0
    assert torch.equal(y[base], y0[base])  # the base model's rows: bit for bit untouched
    if (~base).any():
        assert not torch.equal(y[~base], y0[~base])


@needs_triton
@pytest.mark.parametrize("path", list(PATHS))
def test_lower_ranks_zero_padded_and_max_rank(path: str) -> None:
    """Adapters of rank 3 and 5 zero-padded to R 8: the same as their own-rank products, and
    max_rank=5 (reading 5 of the 8 rows) gives the same again."""
    x, a, b, slots, y, offsets = make_case("qkv-mixed", torch.float32, seed=2)
    for s, rank in ((0, 3), (1, 5), (2, 5)):
        for i in range(len(offsets) - 1):
            a[s, i * 8 + rank:(i + 1) * 8] = 0
        b[s, :, rank:] = 0
    expect = naive(x, a, b, slots, y, offsets, rank=5)
    for max_rank in (None, 5):
        out = y.clone()
        lora_apply(x, a, b, slots, out, offsets, max_rank=max_rank, config=PATHS[path])
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    lora_apply_ref(x, a, b, slots, y, offsets, max_rank=5)
    torch.testing.assert_close(y, expect, atol=1e-5, rtol=1e-5)


@needs_triton
def test_shrink_and_expand_alone() -> None:
    x, a, b, slots, y, offsets = make_case("qkv-mixed", torch.float32, seed=3)
    h = lora_shrink(x, a, slots, config=PATHS["by-slot"])
    safe = slots.clamp_min(0).long()
    expect = torch.einsum("tk,tjk->tj", x, a[safe]) * (slots >= 0)[:, None]
    torch.testing.assert_close(h, expect, atol=1e-5, rtol=1e-5)
    ref = y.clone()
    lora_expand(h, b, slots, y, offsets, config=PATHS["walk"])
    lora_apply_ref(x, a, b, slots, ref, offsets)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_empty_batch_and_bad_arguments() -> None:
    x, a, b, slots, y, offsets = make_case("gate-up-runs", torch.float32)
    lora_apply(x[:0], a, b, slots[:0], y[:0], offsets)
    with pytest.raises(ValueError, match="must run from 0"):
        lora_apply(x, a, b, slots, y, (0, 20, 39))
    with pytest.raises(ValueError, match="do not fit"):
        lora_apply(x, a, b, slots, y, (0, 40))  # 1 slice, but A holds 2
    with pytest.raises(ValueError, match="int32"):
        lora_apply(x, a, b, slots.long(), y, offsets)
    with pytest.raises(ValueError, match="max_rank"):
        lora_apply(x, a, b, slots, y, offsets, max_rank=17)


@needs_triton
def test_fused_counters_survive_many_calls() -> None:
    """The split fused path's arrival counters, shared by every call, are left 0: calls of
    other splits after one another (4 parts of K 40: the last one empty) each finish every
    block once, by its last K part."""
    x, a, b, slots, y, offsets = make_case("qkv-mixed", torch.float32, seed=4)
    expect = y.clone()
    for split, by_slot in ((2, True), (4, False), (1, True), (2, False), (4, True)):
        lora_apply_ref(x, a, b, slots, expect, offsets)
        cfg = FusedConfig(16, 16, 16, split, by_slot, 1, 1)
        lora_apply(x, a, b, slots, y, offsets, config=cfg)
        assert not lora._TICKETS[y.device].any()
    torch.testing.assert_close(y, expect, atol=1e-4, rtol=1e-5)


def test_choose_config_by_batch_size() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert choose_config(1, 2048, 3072) == INTERPRET_FUSED[2, True]
        assert choose_config(300, 2048, 3072) == INTERPRET_CONFIGS[True]
        assert choose_config(8192, 2048, 3072) == INTERPRET_CONFIGS[False]
        return
    fused = choose_config(FUSED_MAX_T, 2048, 3072)
    assert isinstance(fused, FusedConfig) and fused.split_k == 4  # K in 4 parts of 512
    assert choose_config(1, 2048, 16384).split_k == 1  # gate_up: 128 chunks fill the GPU
    decode, prefill = choose_config(300, 2048, 3072), choose_config(8192, 2048, 3072)
    assert isinstance(decode, LoRAConfig) and isinstance(prefill, LoRAConfig)
    assert decode.by_slot and not prefill.by_slot
    assert decode.shrink[:3] == (64, 128, 4)  # 5 64-row tiles, K split into 4 parts of 512
    assert prefill.shrink[:3] == (64, 128, 1)  # 128 tiles fill the GPU alone
    assert choose_config(256, 8192, 2048).shrink[2] == 16  # 4 tiles, parts of 512


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size tiles need a GPU")
@pytest.mark.parametrize("tokens", [1, 7, 64, 200, 1000])
def test_default_tiles_at_model_sizes(tokens: int) -> None:
    """lora_apply's own choice of tiles (fused at decode sizes, split above), bf16, a GQA qkv
    of 512-wide in features and 4 adapters interleaved with base-model rows."""
    gen = torch.Generator().manual_seed(tokens)
    k, r, offsets = 512, 16, (0, 512, 640, 768)
    x = torch.randn(tokens, k, generator=gen).to(DEVICE, torch.bfloat16)
    a = (torch.randn(4, 3 * r, k, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    b = (torch.randn(4, 768, r, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    slots = (torch.arange(tokens) % 5 - 1).to(DEVICE, torch.int32)
    y = torch.randn(tokens, 768, generator=gen).to(DEVICE, torch.bfloat16)
    ref = y.clone()
    lora_apply(x, a, b, slots, y, offsets)
    lora_apply_ref(x, a, b, slots, ref, offsets)
    torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_replays_from_a_cuda_graph_with_new_slots(tokens: int) -> None:
    """No host sync and shape-only grids: one capture serves any slot assignment (T = 1: the
    fused launch, its split-K counters left 0 replay after replay)."""
    x = torch.randn(tokens, 256, device=DEVICE, dtype=torch.bfloat16)
    a = torch.randn(3, 32, 256, device=DEVICE, dtype=torch.bfloat16) * 0.1
    b = torch.randn(3, 384, 16, device=DEVICE, dtype=torch.bfloat16) * 0.1
    slots = torch.full((tokens,), -1, device=DEVICE, dtype=torch.int32)
    y = torch.zeros(tokens, 384, device=DEVICE, dtype=torch.bfloat16)
    offsets = (0, 256, 384)
    lora_apply(x, a, b, slots, y, offsets)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(x, a, b, slots, y, offsets)
    slots.copy_(torch.arange(tokens, device=DEVICE) % 4 - 1 if tokens > 1 else slots + 3)
    ref = torch.zeros_like(y)
    lora_apply_ref(x, a, b, slots, ref, offsets)
    for _ in range(3):
        y.zero_()
        graph.replay()
        torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=2e-2)
