"""Verification steps replayed from decode graphs, one row per token (engine/spec_graphs.py).

On the CPU no graph is captured: the padded static-buffer step a replay computes runs eagerly
(`DecodeGraphs.run_eagerly`) on the Triton kernels in the interpreter, and its greedy tokens must
equal plain decoding's. On a GPU the captured graphs must give the eager engine's tokens."""

from __future__ import annotations

import pytest
import test_spec_decode
import torch

from engine.attention.metadata import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec_graphs import as_decode_rows, fits_as_decode_rows, verify_sizes

copy_llama_dir = test_spec_decode.copy_llama_dir  # a fixture: a 64-token vocabulary repeats
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# a repetitive prompt (drafts from the start), a plain one (few or none), a short one
PROMPTS = [[1, 5, 6, 7, 8] * 4, [1, 30, 17, 40, 23, 58, 9], [1, 3]]


def test_verify_sizes_are_b_times_k_plus_1_over_the_ladder():
    assert verify_sizes(64, 5, 512) == [6, 12, 24, 48, 96, 144, 192, 240, 288, 336, 384]
    assert verify_sizes(64, 5, 200) == [6, 12, 24, 48, 96, 144, 192]
    graphs = DecodeGraphs(torch.nn.Identity(), [], 4, 256, 16, torch.device("cpu"),
                          extra_sizes=verify_sizes(4, 3, 512))
    assert graphs.sizes == [1, 2, 4, 8, 16] and graphs.max_batch == 16
    assert graphs.seq_lens.shape == (16,) and graphs.block_tables.shape == (16, 16)


def _meta(chunks: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """A step of (new tokens, context length after the step) per sequence, prefills first."""
    starts = [0]
    for q, _ in chunks:
        starts.append(starts[-1] + q)
    lens = [n for _, n in chunks]
    prefills = sum(1 for q, _ in chunks if q > 1)
    return AttentionMetadata(
        num_prefills=prefills, num_prefill_tokens=starts[prefills],
        num_decodes=len(chunks) - prefills,
        slot_mapping=torch.arange(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens), block_size=16,
    )


def test_decode_rows_of_the_note_example():
    # r0: last + 3 drafts at 40..43; r1: last + 1 draft at 90, 91; r2: a plain decode at 17
    meta = _meta([(4, 44), (2, 92), (1, 18)], [[3, 1, 7, 0, 0, 0], [9, 8, 2, 5, 6, 4],
                                              [11, 0, 0, 0, 0, 0]])
    positions = torch.tensor([40, 41, 42, 43, 90, 91, 17])
    rows = as_decode_rows(positions, meta)
    assert (rows.num_prefills, rows.num_decodes, rows.num_tokens) == (0, 7, 7)
    assert rows.seq_lens.tolist() == rows.seq_lens_cpu == [41, 42, 43, 44, 91, 92, 18]
    assert rows.block_tables[:, 0].tolist() == [3, 3, 3, 3, 9, 9, 11]
    assert torch.equal(rows.slot_mapping, meta.slot_mapping)
    assert fits_as_decode_rows(meta, 4, 7)
    assert not fits_as_decode_rows(meta, 3, 7)  # r0's chunk is longer
    assert not fits_as_decode_rows(meta, 4, 6)  # more rows than the largest graph


def _llm(path: str, spec: dict | None, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 16 << 20)
    return test_spec_decode.verify_every_draft(LLM(
        path, dtype="float32", device=DEVICE, attention_backend="triton", max_model_len=256,
        max_num_seqs=4, speculative_config=spec, seed=0, **kwargs))


def _tokens(llm: LLM, max_tokens: int, lora_request=None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                        lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs]


def _replay_eagerly(llm: LLM, monkeypatch) -> list[tuple[int, int]]:
    """Give `llm` (CPU) the graphs a GPU would capture, run eagerly; return the (rows, padded
    size) of every step they serve."""
    monkeypatch.setattr(DecodeGraphs, "capture", DecodeGraphs.run_eagerly)
    runner = llm.llm_engine.runner
    runner.graphs = runner._make_graphs()
    served: list[tuple[int, int]] = []
    for graphs in (runner.graphs, getattr(runner.drafter, "graphs", None)):
        if graphs is not None:
            real = graphs.run

            def run(input_ids, positions, meta, real=real, graphs=graphs):
                served.append((meta.num_decodes,
                               next(s for s in graphs.sizes if s >= meta.num_decodes)))
                return real(input_ids, positions, meta)

            monkeypatch.setattr(graphs, "run", run)
    return served


def test_torch_decode_rows_equal_the_chunked_forward(copy_llama_dir, monkeypatch):
    """Every verification step, also run as decode rows (torch backend, no padding), gives the
    chunked forward's hidden states."""
    llm = test_spec_decode.verify_every_draft(LLM(
        copy_llama_dir, dtype="float32", device="cpu", attention_backend="torch",
        max_model_len=256, kv_cache_memory=16 << 20, speculative_config=NGRAM))
    runner = llm.llm_engine.runner
    real, checked = runner._forward, []

    def both(input_ids, positions, meta, on_layer):
        if not meta.num_prefills or not fits_as_decode_rows(meta, 4, 10**6):
            return real(input_ids, positions, meta, on_layer)
        rows = as_decode_rows(positions, meta)
        alt = runner.model(input_ids, positions, runner.kv_caches, rows)
        out = real(input_ids, positions, meta, on_layer)  # its K/V written last, as without
        torch.testing.assert_close(alt, out, rtol=1e-4, atol=1e-4)
        checked.append(meta.num_prefills)
        return out

    monkeypatch.setattr(runner, "_forward", both)
    _tokens(llm, 12)
    assert checked and max(checked) >= 1


@pytest.mark.skipif(CUDA, reason="the CPU stand-in for graphs; the GPU test captures them")
@pytest.mark.parametrize("draft", [False, True])
def test_padded_replays_give_plain_decoding_tokens(copy_llama_dir, monkeypatch, draft):
    """n-gram drafts, or the target as its own draft (its passes replayed too)."""
    max_tokens = 10
    want = _tokens(_llm(copy_llama_dir, None), max_tokens)
    spec = {"model": copy_llama_dir, "num_speculative_tokens": 3} if draft else NGRAM
    llm = _llm(copy_llama_dir, spec)
    served = _replay_eagerly(llm, monkeypatch)
    assert _tokens(llm, max_tokens) == want
    runner = llm.llm_engine.runner
    assert runner.graphs.row_replays > 0  # verification steps went through the graphs
    assert any(n < size for n, size in served)  # some padded: padding rows changed nothing
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0
    if draft:
        assert runner.drafter.graphs.replays > 0


@pytest.mark.skipif(CUDA, reason="the CPU stand-in for graphs")
def test_padded_replays_with_a_lora_adapter(copy_llama_dir, tmp_path, monkeypatch):
    from lora_helpers import make_adapter

    from engine.lora import LoRARequest

    lora = LoRARequest("a", 1, make_adapter(copy_llama_dir, tmp_path / "a", rank=4, scale=3.0))
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    want = _tokens(_llm(copy_llama_dir, None, **kwargs), 8, lora)
    llm = _llm(copy_llama_dir, NGRAM, **kwargs)
    _replay_eagerly(llm, monkeypatch)
    assert _tokens(llm, 8, lora) == want
    assert llm.llm_engine.runner.graphs.row_replays > 0


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("draft", [False, True])
def test_graph_replayed_verification_equals_eager(copy_llama_dir, draft):
    spec = {"model": copy_llama_dir, "num_speculative_tokens": 3} if draft else NGRAM
    eager = _tokens(_llm(copy_llama_dir, spec, enforce_eager=True), 32)
    llm = _llm(copy_llama_dir, spec)
    assert _tokens(llm, 32) == eager
    runner = llm.llm_engine.runner
    assert runner.graphs is not None and runner.graphs.row_replays > 0
    if draft:
        assert runner.drafter.graphs is not None and runner.drafter.graphs.replays > 0
