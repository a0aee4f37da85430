"""`moe_align` (kernels/moe_align.py, one Triton program) against its torch reference, exactly:
the module NOTE's example, other ranks' experts, and random routings whose pairs span several of
the kernel's chunks; on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.moe_align import moe_align, moe_align_ref, num_slots  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("align", [moe_align, moe_align_ref], ids=["kernel", "ref"])
def test_pads_each_expert_to_the_tile(align) -> None:
    # the NOTE's example: pairs 0..5 of [[2, 0], [2, 1], [0, 2]], BLOCK_M 4, 4 experts
    topk_ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    sorted_ids, tile_experts, num_padded = align(topk_ids, 4, 4)
    pad = 6
    assert num_slots(6, 4, 4) == 20 and sorted_ids.shape == (20,) and tile_experts.shape == (5,)
    assert num_padded.tolist() == [12]
    assert sorted_ids[:12].tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert tile_experts.tolist() == [0, 1, 2, 3, 3]  # expert 3: no tile; the tail clamps to E-1
    assert torch.all(sorted_ids[12:] == pad)  # worst-case tail, skipped by the GEMMs
    assert sorted_ids.dtype == tile_experts.dtype == num_padded.dtype == torch.int32


@pytest.mark.parametrize("align", [moe_align, moe_align_ref], ids=["kernel", "ref"])
def test_leaves_out_other_ranks_experts(align) -> None:
    topk_ids = torch.tensor([[-1, 1], [3, 1]], device=DEVICE)  # -1, 3: not among [0, 2)
    sorted_ids, tile_experts, num_padded = align(topk_ids, 2, 4)
    assert num_padded.tolist() == [4]
    assert sorted_ids.tolist() == [1, 3] + [4] * 10  # 12 slots: 4 pairs in 2 experts' worst
    assert tile_experts.tolist() == [1, 1, 1]


CASES = {  # (tokens, top_k, experts, block_m, seed)
    "one-token": (1, 2, 8, 16, 0),
    "mixtral-64": (64, 2, 8, 16, 1),
    "many-chunks": (300, 2, 8, 64, 2),  # 600 pairs: 3 chunks of 256
    "40-experts-top8": (37, 8, 40, 16, 3),
    "128-experts": (50, 8, 128, 32, 4),  # chunks of 32 pairs
    "int32-ids-and-strangers": (45, 3, 6, 8, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_reference(case: str) -> None:
    tokens, top_k, experts, block_m, seed = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if case.startswith("int32"):
        ids[::4, 0] = -1  # other ranks' experts
        ids[1::5, 1] = experts + 2
        ids = ids.to(torch.int32)
    ids = ids.to(DEVICE)
    got = moe_align(ids, experts, block_m)
    want = moe_align_ref(ids, experts, block_m)
    for g, w, name in zip(got, want, ("sorted_ids", "tile_experts", "num_padded"), strict=True):
        assert torch.equal(g.cpu(), w.cpu()), name


def test_rejects_bad_arguments() -> None:
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="int32/int64"):
        moe_align(ids.float(), 4, 16)
    with pytest.raises(ValueError, match="power-of-2 block_m"):
        moe_align(ids, 4, 24)
