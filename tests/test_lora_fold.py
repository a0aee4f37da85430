"""Multi-LoRA with the shrink folded into the base GEMV (engine/lora/layers.py): the expand kernel
(kernels/lora_fold.py) against its torch reference and a naive loop (CPU: Triton's interpreter),
and a wrapped projection's folded path against the shrink-and-expand path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.distributed.group import SingleRank
from engine.lora.layers import FOLD_MAX_TOKENS, LoRAContext, LoRALinear
from engine.models.tp_layers import Linear, RowParallelLinear
from kernels.lora import lora_apply_ref
from kernels.lora_fold import lora_fold_expand, lora_fold_expand_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the kernel needs triton")

# name -> (slice_offsets, rank R, slots S, per-token slots, swiglu); -1: no adapter
CASES = {
    "qkv": ((0, 96, 120, 144), 8, 3, [2, -1, 0], False),  # GQA, a column tile across slices
    "o-one-token": ((0, 80), 4, 4, [3], False),  # R 4: padded rows of the tile masked
    "gate-up-swiglu": ((0, 72, 144), 16, 2, [1, 0, -1, 1], True),
    "all-base": ((0, 40, 80), 8, 2, [-1, -1], True),
}


def make_case(name: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    """full [T, N + S * n * R], lora_b, slots, offsets, swiglu on DEVICE."""
    offsets, r, s, slot_list, swiglu = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    n, n_slices = offsets[-1], len(offsets) - 1
    full = torch.randn(len(slot_list), n + s * n_slices * r, generator=gen)
    b = torch.randn(s, n, r, generator=gen) * 0.3
    slots = torch.tensor(slot_list, dtype=torch.int32)
    return (full.to(DEVICE, dtype), b.to(DEVICE, dtype), slots.to(DEVICE), offsets, swiglu)


def naive(full, b, slots, offsets, swiglu) -> torch.Tensor:
    """Token by token, slice by slice, in fp32, rounded once (SwiGLU after that rounding)."""
    s_n, n, r = b.shape
    n_slices = len(offsets) - 1
    out = full[:, :n].float().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            first = n + (s * n_slices + i) * r
            out[t, lo:hi] += b[s, lo:hi].float() @ full[t, first:first + r].float()
    out = out.to(full.dtype)
    if swiglu:
        gate, up = out.float().chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up).to(full.dtype)
    return out


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_a_naive_loop(case: str) -> None:
    full, b, slots, offsets, swiglu = make_case(case, torch.float32)
    got = lora_fold_expand_ref(full, b, slots, offsets, swiglu=swiglu)
    torch.testing.assert_close(got, naive(full, b, slots, offsets, swiglu), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case: str, dtype: torch.dtype) -> None:
    full, b, slots, offsets, swiglu = make_case(case, dtype, seed=1)
    got = lora_fold_expand(full, b, slots, offsets, swiglu=swiglu)
    want = lora_fold_expand_ref(full, b, slots, offsets, swiglu=swiglu)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))
    base = slots < 0
    if not swiglu:  # the base model's rows: y itself, bit for bit
        assert torch.equal(got[base], full[base, :offsets[-1]])


def test_bad_arguments() -> None:
    full, b, slots, offsets, _ = make_case("qkv", torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        lora_fold_expand(full[:, :-1], b, slots, offsets)
    with pytest.raises(ValueError, match="two equal slices"):
        lora_fold_expand(full, b, slots, offsets, swiglu=True)
    with pytest.raises(ValueError, match="int32"):
        lora_fold_expand(full, b, slots.long(), offsets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replays_from_a_cuda_graph_with_new_slots() -> None:
    full, b, slots, offsets, _ = make_case("qkv", torch.bfloat16, seed=2)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    out = lora_fold_expand(full, b, slots, offsets, pdl=pdl)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_fold_expand(full, b, slots, offsets, pdl=pdl)
    for new in ([0, 1, 2], [-1, -1, 1]):
        slots.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        want = lora_fold_expand_ref(full, b, slots, offsets)
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=2e-2)


def _wrapped(seed: int = 0) -> tuple[LoRALinear, torch.Tensor, torch.Tensor]:
    """A q/k/v-like Linear (48 -> 24 + 8 + 8) wrapped with 3 slots of rank 8; slots 0 and 2
    hold random adapters (slot 2 of rank 4, no v). Returns it, the base weight's values, and
    the weight's storage size before wrapping."""
    gen = torch.Generator().manual_seed(seed)
    base = Linear(48, 40, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(40, 48, generator=gen))
    before = base.weight.detach().clone()
    slices = {"q": (range(24), 24), "k": (range(8), 8), "v": (range(8), 8)}
    layer = LoRALinear(base, 48, slices, 3, 8, LoRAContext(), torch.float32,
                       torch.device("cpu"))
    for slot, rank, names in ((0, 8, "qkv"), (2, 4, "qk")):
        weights = {}
        for name in names:
            out = slices[name][1]
            weights[name] = (torch.randn(rank, 48, generator=gen),
                             torch.randn(out, rank, generator=gen))
        layer.set_slot(slot, weights)
    return layer, before, gen.manual_seed(seed + 1)


def test_folded_weight_shares_the_base_rows() -> None:
    """The base weight is a view of the folded rows (no second copy); slot loads land in the A
    rows below it; the base output is unchanged."""
    layer, before, _ = _wrapped()
    w = layer.base.weight
    assert layer.folded is not None and layer.folded.shape == (40 + 3 * 3 * 8, 48)
    assert w.data_ptr() == layer.folded.data_ptr() and torch.equal(w, before)
    assert layer.lora_a.data_ptr() == layer.folded[40:].data_ptr()
    assert layer.folded[40 + 24:40 + 48].abs().sum() == 0  # slot 1: empty
    x = torch.randn(3, 48)
    torch.testing.assert_close(layer(x), x @ before.T)  # no slots: the base alone


@pytest.mark.parametrize("slot_list", [[0], [2, -1, 0], [1, 2, 0, -1], [0, 2] * 4])
def test_folded_path_equals_shrink_and_expand(slot_list: list[int]) -> None:
    """Up to FOLD_MAX_TOKENS tokens the folded GEMV and expand; above, the two-pass path:
    both equal y + B (A x) as lora_apply_ref computes it."""
    layer, before, gen = _wrapped(1)
    x = torch.randn(len(slot_list), 48, generator=gen)
    slots = torch.tensor(slot_list, dtype=torch.int32)
    layer.ctx.slots = slots
    want = x @ before.T
    lora_apply_ref(x, layer.lora_a, layer.lora_b, slots, want, layer.offsets)
    assert layer._folds(x) == (len(slot_list) <= FOLD_MAX_TOKENS)
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)


def test_row_parallel_folds_its_columns_of_a() -> None:
    """A row-parallel projection (o/down) holding input columns 16..39 of 40: its folded rows
    carry A's columns of this rank, and the folded path equals y_r + B (A_r x_r)."""
    gen = torch.Generator().manual_seed(3)
    cols = range(16, 40)
    base = RowParallelLinear(40, 32, cols, bias=False, tp=SingleRank())
    with torch.no_grad():
        base.weight.copy_(torch.randn(32, 24, generator=gen))
    w = base.weight.detach().clone()
    layer = LoRALinear(base, 40, {"o": (range(32), 32)}, 2, 8, LoRAContext(), torch.float32,
                       torch.device("cpu"), cols)
    a, b = torch.randn(8, 40, generator=gen), torch.randn(32, 8, generator=gen)
    layer.set_slot(1, {"o": (a, b)})
    assert layer.folded is not None and layer.folded.shape == (32 + 2 * 8, 24)
    x = torch.randn(2, 24, generator=gen)
    layer.ctx.slots = torch.tensor([1, -1], dtype=torch.int32)
    want = x @ w.T
    want[0] += b @ (a[:, 16:40] @ x[0])
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)
