"""The small fused Triton kernels (RMSNorm with residual, SiLU-and-mul, rotary) against their
torch references; on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from kernels.rotary import cos_sin_cache, rotary_embedding, rotary_embedding_ref  # noqa: E402
from kernels.silu_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal in fp32 up to rounding; within one or two 16-bit ulps otherwise (the interpreter
    truncates when it casts to bf16, the GPU rounds to nearest)."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        eps = torch.finfo(out.dtype).eps
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=2 * eps)


def randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 576])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    x, res = randn(5, hidden, dtype=dtype, seed=1), randn(5, hidden, dtype=dtype, seed=2)
    w = randn(hidden, dtype=dtype, seed=3)
    ulp_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    x_before, res_before = x.clone(), res.clone()
    out, new_res = rms_norm(x, w, 1e-5, residual=res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, residual=res)
    ulp_close(new_res, ref_res)
    ulp_close(out, ref_out)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched


def test_rms_norm_of_a_transposed_view_is_the_norm_of_its_rows():
    """An input whose rows are not contiguous (an embedding built as W^T columns) is normed row
    by row, not read as if it were row-major."""
    x = randn(48, 5, dtype=torch.float32, seed=5).t()  # [5, 48], stride (1, 5)
    res = randn(48, 5, dtype=torch.float32, seed=6).t()
    w = randn(48, dtype=torch.float32, seed=7)
    ulp_close(rms_norm(x, w, 1e-5), rms_norm_ref(x.contiguous(), w, 1e-5))
    out, new_res = rms_norm(x, w, 1e-5, residual=res)
    ref_out, ref_res = rms_norm_ref(x.contiguous(), w, 1e-5, residual=res.contiguous())
    ulp_close(out, ref_out)
    ulp_close(new_res, ref_res)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    x = randn(6, 2 * 1536, dtype=dtype, seed=4)  # 1536 columns: more than one column tile
    ulp_close(silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=str)
def test_rotary_in_place_on_fused_qkv_views(dtype, heads):
    num_heads, kv_heads = heads
    head_dim, tokens = 16, 7
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + kv_heads) * head_dim].view(
        tokens, kv_heads, head_dim)
    v_before = qkv[:, (num_heads + kv_heads) * head_dim :].clone()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cache = cos_sin_cache(inv_freq, 128, torch.device(DEVICE))
    positions = torch.tensor([0, 5, 127, 2, 2, 9, 64], device=DEVICE)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cache)
    rotary_embedding(positions, q, k, cache)
    ulp_close(q, ref_q)
    ulp_close(k, ref_k)
    assert torch.equal(qkv[:, (num_heads + kv_heads) * head_dim :], v_before)  # v untouched


def test_rotary_matches_the_models_torch_rotary():
    """The kernel's cache and formula give the engine's (HF's) rotate_half result."""
    from engine.models.rotary import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 1, 17, 100], device=DEVICE)
    q = randn(4, 3, 16, dtype=torch.float32, seed=6)
    k = randn(4, 1, 16, dtype=torch.float32, seed=7)
    cos, sin = rope(positions, torch.float32)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rotary_embedding(positions, q, k, cos_sin_cache(rope.inv_freq, 128, torch.device(DEVICE)))
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, expected_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=str)
def test_rope_and_store_equals_rotary_then_store(dtype, heads):
    """On views of a fused qkv row, as the model hands them over: q rotated in place, rotated k
    and v at their slots (-1: a graph's padding row, no write), k itself and every other slot
    untouched."""
    from kernels.rope_store import rope_and_store, rope_and_store_ref

    num_heads, kv_heads = heads
    head_dim, tokens, block_size, num_blocks = 16, 7, 4, 10
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=8)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + kv_heads) * head_dim].view(
        tokens, kv_heads, head_dim)
    v = qkv[:, (num_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = cos_sin_cache(inv_freq, 128, torch.device(DEVICE))
    positions = torch.tensor([0, 5, 127, 2, 2, 9, 64], device=DEVICE)
    slots = torch.tensor([3, -1, 39, 0, 17, -1, 22], device=DEVICE)  # shuffled, 2 padding rows
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=9)
    expected_cache, expected_q, k_before = cache.clone(), q.clone(), k.clone()
    rope_and_store_ref(positions, expected_q, k.clone(), v, expected_cache[0],
                       expected_cache[1], slots, cos_sin)
    rope_and_store(positions, q, k, v, cache[0], cache[1], slots, cos_sin)
    ulp_close(q, expected_q)
    ulp_close(cache, expected_cache)
    written = slots[slots >= 0]
    flat, expected_flat = cache.view(2, -1, kv_heads, head_dim), expected_cache.view(
        2, -1, kv_heads, head_dim)
    assert torch.equal(flat[1, written], expected_flat[1, written])  # v copied exactly
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], expected_flat[:, untouched])
    assert torch.equal(k, k_before)
