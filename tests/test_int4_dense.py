"""engine/quant/int4_dense.py: the dense bf16 matrix read back from torch's packed CPU int4
weights equals the exact de-quantization rounded once to bf16, and the GGUF kernels take it
for steps of DENSE_MIN_TOKENS rows or more (within the bf16 kernels' tolerance of gguf's own
de-quantization), the int4 GEMM below that. These are the kernels where kernels/cpu_nibble.c
does not run, so make_kernel is kept from picking it here."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from test_quant_gguf import TOLERANCE, random_blocks

from engine.quant import int4_dense
from engine.quant.blocks import unpack
from engine.quant.int4_dense import DENSE_MIN_TOKENS, dense_weight_t, has_bf16_dot, pack_block_rows
from engine.quant.kernels import Int4PackKernel, int4pack_available, make_kernel, reference_linear
from kernels import cpu_nibble

Q = GGMLQuantizationType
needs_dense = pytest.mark.skipif(
    not int4pack_available() or pack_block_rows() is None,
    reason="no packed int4 CPU kernel, no bf16 dot product, or an unknown packing",
)


@pytest.fixture(autouse=True)
def _torch_int4_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_nibble, "preferred", lambda: False)


@needs_dense
@pytest.mark.parametrize("shape", [(192, 64), (128, 96)])  # 3 blocks of 64 rows; 3 groups of K
def test_dense_weight_is_the_exact_dequantization_rounded_to_bf16(shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(0)
    nibbles = torch.randint(0, 16, (n, k), generator=g)
    scale, zero = torch.rand(n, k // 32, generator=g) * 0.02, torch.randn(n, k // 32, generator=g)
    kernel = Int4PackKernel(nibbles, scale, zero)
    sz = kernel.scales_and_zeros.float()  # the bf16 scales and zeros the int4 GEMM reads
    exact = (nibbles.float().view(n, k // 32, 32) - 8) * sz[..., 0].t()[..., None]
    exact = (exact + sz[..., 1].t()[..., None]).view(n, k)
    got = dense_weight_t(kernel.packed, kernel.scales_and_zeros)
    assert got.dtype == torch.bfloat16 and got.shape == (k, n)
    # within half a bf16 ulp of the exact value, plus the rounding of z - 8 s to bf16
    bound = exact.abs() * 2**-8 + (sz[..., 1] - 8 * sz[..., 0]).abs().max() * 2**-8
    assert ((got.float().t() - exact).abs() <= bound).all()


@needs_dense
@pytest.mark.skipif(not has_bf16_dot(), reason="no bf16 dot product: the int4 GEMM stays faster")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_many_token_steps_take_the_dense_weight_and_match_the_reference(
    qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, cols, tokens = 192, 256, DENSE_MIN_TOKENS
    raw = random_blocks(qtype, rows, cols, seed=4)
    kernel = make_kernel(unpack(qtype, raw, (rows, cols), "w"), torch.bfloat16)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(5)).bfloat16()
    calls = []
    real = int4_dense.dense_weight_t
    monkeypatch.setattr("engine.quant.kernels.dense_weight_t",
                        lambda *a: calls.append(1) or real(*a))
    ref = reference_linear(x, raw, qtype, (rows, cols))
    for t in (tokens - 1, tokens):
        calls.clear()
        out = kernel(x[:t])
        assert bool(calls) == (t >= DENSE_MIN_TOKENS)  # one matrix, or both int8 halves
        err = (out.float() - ref[:t]).abs().max().item()
        assert err <= TOLERANCE[torch.bfloat16] * ref.abs().max().item(), err


@needs_dense
def test_without_a_bf16_dot_product_many_token_steps_keep_the_int4_gemm(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int4_dense, "has_bf16_dot", lambda: False)  # an AVX2-only CPU
    raw = random_blocks(Q.Q4_1, 192, 256, seed=4)
    kernel = make_kernel(unpack(Q.Q4_1, raw, (192, 256), "w"), torch.bfloat16)
    x = torch.randn(DENSE_MIN_TOKENS, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    monkeypatch.setattr("engine.quant.kernels.dense_weight_t", lambda *a: pytest.fail("dense"))
    ref = reference_linear(x, raw, Q.Q4_1, (192, 256))
    err = (kernel(x).float() - ref).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16] * ref.abs().max().item(), err


def test_no_dense_path_where_rows_are_not_whole_blocks() -> None:
    if not int4pack_available():
        pytest.skip("no packed int4 CPU kernel")
    kernel = Int4PackKernel(torch.randint(0, 16, (80, 64)), torch.rand(80, 2), torch.rand(80, 2))
    assert not kernel.densifies  # 80 rows: not a multiple of 64 (or of 32 with 16 left)


def test_rows_read_back_from_the_packing_equal_the_nibbles() -> None:
    if not int4pack_available() or int4_dense.pack_block_rows() is None:
        pytest.skip("no packed int4 CPU kernel, or an unknown packing")
    nibbles = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(6))
    packed = Int4PackKernel(nibbles, torch.rand(192, 3), torch.rand(192, 3)).packed
    ids = torch.tensor([0, 31, 32, 63, 64, 191, 100, 5, 5])
    assert torch.equal(int4_dense.nibble_rows(packed, ids), nibbles[ids].to(torch.uint8))
