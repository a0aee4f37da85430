"""The fused MoE kernel (kernels/fused_moe.py) against its torch reference and the engine's CPU
loop; on CPU through Triton's interpreter (tests/test_moe_align.py checks the sorted layout)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.models.moe import moe_loop  # noqa: E402
from kernels.fused_moe import (  # noqa: E402
    LARGE_M,
    SMALL_M,
    fused_moe,
    fused_moe_ref,
    tile_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 48, 40  # K steps of 16 that end mid-tile (40), N tiles that straddle


def experts(num_experts: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * 0.2
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def routing(ids: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], softmax-ish weights [T, K] and the given ids [T, K]."""
    gen = torch.Generator().manual_seed(seed)
    topk_ids = torch.tensor(ids, dtype=torch.int64)
    weights = torch.rand(topk_ids.shape, generator=gen).softmax(-1)
    x = torch.randn(topk_ids.shape[0], HIDDEN, generator=gen)
    return x.to(DEVICE), weights.to(DEVICE), topk_ids.to(DEVICE)


CASES = {
    # (num_experts, ids per token): ragged loads, expert 3 of 5 gets nothing
    "ragged-top2": (5, [[0, 1], [1, 2], [1, 4], [0, 1], [2, 4], [1, 0], [4, 2]]),
    "one-expert-takes-all-top1": (4, [[2]] * 19),  # 19 tokens: more than one 16-row tile
    "top3-some-idle": (6, [[5, 0, 2], [2, 5, 0], [0, 2, 5]]),
    "single-token": (8, [[7, 3]]),
    "other-ranks-experts": (3, [[0, 4], [-1, 2], [5, 1]]),  # ids outside [0, 3) add nothing
    # PowerMoE's routing: top 8 of 40 experts (most experts idle, many one-token tiles)
    "40-experts-top8": (40, [[(7 * t + 5 * k) % 40 for k in range(8)] for t in range(2)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_matches_reference(case: str, dtype: torch.dtype) -> None:
    num_experts, ids = CASES[case]
    w13, w2 = experts(num_experts, dtype, seed=1)
    x, weights, topk_ids = routing(ids, seed=2)
    x = x.to(dtype)
    out = fused_moe(x, w13, w2, weights, topk_ids)
    ref = fused_moe_ref(x, w13, w2, weights, topk_ids)
    assert out.shape == x.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    loop = moe_loop(x.float(), w13.float(), w2.float(), weights, topk_ids)
    torch.testing.assert_close(loop, ref, atol=1e-5, rtol=1e-5)  # the engine's CPU path


def test_fused_moe_with_a_large_tile_config_and_no_tokens() -> None:
    w13, w2 = experts(4, torch.float32, seed=3)
    x, weights, topk_ids = routing([[3, 0], [0, 3], [3, 1]], seed=4)
    out = fused_moe(x, w13, w2, weights, topk_ids, config=(32, 32, 32, 2, 4, 2))
    torch.testing.assert_close(
        out, fused_moe_ref(x, w13, w2, weights, topk_ids), atol=1e-5, rtol=1e-5
    )
    empty = fused_moe(x[:0], w13, w2, weights[:0], topk_ids[:0])
    assert empty.shape == (0, HIDDEN)


def test_fused_moe_rejects_mismatched_shapes_and_dtypes() -> None:
    w13, w2 = experts(4, torch.float32, seed=5)
    x, weights, topk_ids = routing([[0, 1]], seed=6)
    with pytest.raises(ValueError, match="do not fit hidden"):
        fused_moe(x[:, :32], w13, w2, weights, topk_ids)
    with pytest.raises(ValueError, match="do not fit 1 tokens"):
        fused_moe(x, w13, w2, weights[:, :1], topk_ids)
    with pytest.raises(ValueError, match="experts are"):
        fused_moe(x.double(), w13, w2, weights, topk_ids)


def test_tile_config_defaults_by_tokens_per_expert() -> None:
    assert tile_config(2, 16, 14336, 2048, torch.bfloat16) == SMALL_M  # decode: 1 token
    assert tile_config(2, 16, 2048, 7168, torch.bfloat16)[:2] == (16, 32)  # narrow: more programs
    assert tile_config(1024, 16, 14336, 2048, torch.bfloat16) == LARGE_M  # 64 pairs per expert
    assert tile_config(2, 8, 14336, 2048, torch.float32) == SMALL_M  # tuned for bf16 only


def test_tile_config_takes_the_tuned_entry_for_its_bucket() -> None:
    """gpu_moe's Mixtral-shaped layer (TUNED): 1 token, 64 tokens, 256 and 300 tokens."""
    assert tile_config(2, 8, 14336, 2048, torch.bfloat16) == (16, 32, 64, 8, 4, 3)
    assert tile_config(128, 8, 2048, 7168, torch.bfloat16) == (32, 64, 128, 8, 4, 3)
    for pairs in (512, 600):
        assert tile_config(pairs, 8, 14336, 2048, torch.bfloat16) == (64, 128, 128, 8, 4, 4)
    assert tile_config(96, 8, 14336, 2048, torch.bfloat16) == SMALL_M  # bucket 16: not tuned


def test_the_model_layer_takes_the_fused_path_with_expert_parallel_ids(monkeypatch) -> None:
    """FusedMoE (engine/models/moe.py) of rank 1 of 2 under expert parallelism: its fused path
    (forced on here) gets the ids shifted to its experts 2..3 and equals its loop path."""
    import engine.models.moe as moe

    class Rank1:
        rank, world_size, expert_parallel = 1, 2, True

        def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            return t

    layer = moe.FusedMoE(4, HIDDEN, INTER, Rank1(), expert_parallel=True).to(DEVICE)
    layer.w13.data, layer.w2.data = experts(2, torch.float32, seed=7)
    x, weights, topk_ids = routing([[0, 3], [2, 1], [3, 2], [1, 0]], seed=8)
    with torch.no_grad():
        loop = layer(x, weights, topk_ids)
        monkeypatch.setattr(moe, "use_fused_kernels", lambda _: True)
        fused = layer(x, weights, topk_ids)
    assert torch.equal(loop[3], torch.zeros(HIDDEN, device=DEVICE))  # experts 0, 1: elsewhere
    assert loop[0].abs().sum() > 0
    torch.testing.assert_close(fused, loop, atol=1e-5, rtol=1e-5)


def test_routing_weights_in_the_activation_dtype() -> None:
    """Qwen-MoE and GraniteMoE pass bf16 routing weights (Mixtral fp32): the kernel reads either."""
    w13, w2 = experts(5, torch.bfloat16, seed=11)
    x, weights, topk_ids = routing(CASES["ragged-top2"][1], seed=12)
    x, weights = x.to(torch.bfloat16), weights.to(torch.bfloat16)
    out = fused_moe(x, w13, w2, weights, topk_ids)
    ref = fused_moe_ref(x, w13, w2, weights, topk_ids)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_moe_replays_from_a_cuda_graph_with_new_routing() -> None:
    """No host sync and worst-case sizes: one capture serves any routing of its batch size."""
    w13, w2 = experts(6, torch.bfloat16, seed=9)
    x, weights, topk_ids = routing([[5, 0], [2, 5], [0, 2], [1, 3], [4, 0]], seed=10)
    x = x.to(torch.bfloat16)
    fused_moe(x, w13, w2, weights, topk_ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, topk_ids)
    new_x, new_weights, new_ids = routing([[3, 3], [3, 1], [1, 3], [3, 3], [9, 3]], seed=13)
    x.copy_(new_x.to(torch.bfloat16))
    weights.copy_(new_weights)
    topk_ids.copy_(new_ids)
    graph.replay()
    ref = fused_moe_ref(x, w13, w2, weights, topk_ids)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
