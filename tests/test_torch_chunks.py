"""engine/attention/torch_chunks.py: short chunks over a paged context, batched into one SDPA
call, attend as the per-sequence reference does (kernels/prefill_attention.py's
`prefill_attention_ref`), in a step that also holds a whole prompt, a long chunk and decodes,
over shuffled block tables, GQA, chunks of different lengths straddling block edges, an fp8
cache too; the short path is taken (one SDPA call for the chunks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _model_helpers import SeqChunk, build_metadata, shuffled_block_tables

from engine.attention import torch_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.torch_chunks import SHORT_CHUNK, short_seqs
from kernels.prefill_attention import prefill_attention_ref

BS, HEADS, KV_HEADS, D = 4, 6, 2, 16
# (cached, new): a whole prompt, a long chunk, three short ones, two decodes
SHAPES = [(0, 9), (5, SHORT_CHUNK + 3), (13, 4), (2, SHORT_CHUNK), (7, 2), (6, 1), (17, 1)]


def _step(seed: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in SHAPES]
    tables = shuffled_block_tables(lens, BS, 40, seed)
    chunks = [SeqChunk(t, c, n) for t, (c, n) in zip(tables, SHAPES, strict=True)]
    meta = build_metadata(chunks, BS)
    cache = torch.randn(2, 40, BS, KV_HEADS, D, generator=g).to(dtype)  # earlier context
    tokens = sum(n for _, n in SHAPES)
    q, k, v = (torch.randn(tokens, h, D, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    return meta, cache, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_short_chunks_batched_equal_the_reference(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta, cache, q, k, v = _step(1, dtype)
    assert short_seqs(meta) == (2, 3, 4)
    calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or real_sdpa(*a, **kw))
    scales = (0.5, 0.5) if dtype != torch.float32 else (1.0, 1.0)
    out = TorchAttentionBackend(*scales).forward(q, k, v, cache, meta, D**-0.5)
    # the whole prompt, the long chunk, the three short chunks at once, the two decodes at once
    assert sorted(shape[0] for shape in calls) == [1, 1, 2, 3]
    want = prefill_attention_ref(q, cache[0], cache[1], meta.block_tables, meta.query_start_loc,
                                 meta.seq_lens, D**-0.5, *scales)
    # (a whole prompt attends its k/v as computed, the reference reads the cache: fp8 differs)
    rows = slice(0 if dtype == torch.float32 else SHAPES[0][1], None)
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-5, atol=1e-5)


def test_no_short_chunks_without_earlier_context_when_long_or_alone() -> None:
    chunks = [SeqChunk([0, 1, 2], 0, 5), SeqChunk([3, 4, 5, 6], 2, SHORT_CHUNK + 1),
              SeqChunk([9, 10], 3, 4), SeqChunk([7, 8], 4, 1)]
    assert short_seqs(build_metadata(chunks, BS)) == ()  # one short chunk: not batched
    two = [*chunks[:3], SeqChunk([11, 12], 5, 2), chunks[3]]
    assert short_seqs(build_metadata(two, BS)) == (2, 3)
