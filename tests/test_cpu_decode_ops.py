"""The CPU decode path's cheaper ops compute what the plain ops did, bit for bit: the fp32
RMSNorm through F.rms_norm (engine/models/layers.py), q and k rotated as one view, the
decodes' K/V read by one index_select and the additive mask (engine/attention/
torch_backend.py), the split-int8 head's single input cast (engine/quant/kernels.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import (
    StepMemo,
    TorchAttentionBackend,
    gather_blocks,
    rotate_joint,
)
from engine.models.layers import RMSNorm
from engine.models.rotary import RopeInputs, RotaryEmbedding, rotate_qk
from engine.quant import kernels


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (5, 64), (17, 960), (3, 4096)])
def test_fp32_rms_norm_is_hf_bit_for_bit(tokens: int, hidden: int) -> None:
    torch.manual_seed(tokens)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden)
    x, residual = torch.randn(tokens, hidden) * 7, torch.randn(tokens, hidden)
    assert torch.equal(norm(x), _hf_rms_norm(x, norm.weight, 1e-5))
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, _hf_rms_norm(x + residual, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (17, 960), (300, 64)])
def test_16_bit_rms_norm_is_hf_bit_for_bit(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(tokens)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x, residual = (torch.randn(tokens, hidden) * 7).to(dtype), torch.randn(tokens, hidden).to(dtype)
    assert torch.equal(norm(x), _hf_rms_norm(x, norm.weight, 1e-5))
    out, summed = norm(x, residual)
    assert torch.equal(out, _hf_rms_norm(x + residual, norm.weight, 1e-5))


def _rope(tokens: int, head_dim: int) -> RopeInputs:
    rotary = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    return rotary.inputs(torch.arange(7, 7 + tokens), torch.float32)


@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_rotate_joint_equals_rotate_qk(tokens: int) -> None:
    heads, kv_heads, d = 9, 3, 64
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    rope = _rope(tokens, d)
    want_q, want_k = rotate_qk(rope, q, k)
    memo = StepMemo()
    got_q, got_k = rotate_joint(rope, q, k, memo)  # adjacent: one view
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_k.data_ptr() == got_q.data_ptr() + heads * d * 4  # rotated as one
    apart_q, apart_k = rotate_joint(rope, q.clone(), k.clone(), memo)  # not adjacent
    assert torch.equal(apart_q, want_q) and torch.equal(apart_k, want_k)


def _decode_meta(
    seq_lens: list[int], block_size: int, tables: list[list[int]]
) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size
             for i, n in enumerate(seq_lens)]
    num = len(seq_lens)
    return AttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=num,
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(num + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        query_start_loc_cpu=list(range(num + 1)), seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens), block_size=block_size,
    )


def _reference_decode(q, kv_cache, meta, scale):  # the plain ops: per sequence, bool mask
    outs = []
    heads, d = q.shape[1:]
    for i, n in enumerate(meta.seq_lens_cpu):
        blocks = meta.block_tables[i, : -(-n // meta.block_size)].long()
        k, v = gather_blocks(kv_cache, blocks)
        outs.append(F.scaled_dot_product_attention(
            q[i].view(1, heads, 1, d), k[:n].transpose(0, 1)[None], v[:n].transpose(0, 1)[None],
            scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


def test_decode_reads_every_block_of_shuffled_tables() -> None:
    block_size, kv_heads, heads, d = 16, 3, 9, 64
    torch.manual_seed(1)
    kv_cache = torch.randn(2, 11, block_size, kv_heads, d)
    tables = [[7, 2, 9], [4], [10, 0, 5, 3]]  # odd lengths that straddle block edges
    meta = _decode_meta([33, 16, 50], block_size, tables)
    q, k, v = torch.randn(3, heads, d), torch.randn(3, kv_heads, d), torch.randn(3, kv_heads, d)
    out = TorchAttentionBackend().forward(q, k, v, kv_cache, meta, d**-0.5)
    flat_k = kv_cache[0].view(-1, kv_heads, d)
    assert torch.equal(flat_k[meta.slot_mapping], k)  # stored
    want = _reference_decode(q, kv_cache, meta, d**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not kernels.int4pack_available(), reason="no packed int4 CPU kernel")
def test_split_int8_sums_both_halves_in_fp32() -> None:
    torch.manual_seed(2)
    hi, lo = torch.randint(0, 16, (32, 64)), torch.randint(0, 16, (32, 64))
    scale = torch.rand(32, 2)
    high = kernels.Int4PackKernel(hi, scale * 16, torch.zeros_like(scale))
    low = kernels.Int4PackKernel(lo, scale, scale * 8)
    split = object.__new__(kernels.SplitInt8Kernel)
    split.high, split.low = high, low
    x = torch.randn(3, 64)
    assert torch.equal(split(x), high(x) + low(x))
