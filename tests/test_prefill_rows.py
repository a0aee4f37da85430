"""Steps with prompts' chunks replayed from the decode graphs as decode rows
(engine/spec_graphs.py, `prefill_rows_fit`; off by default, turned on here).

On the CPU no graph is captured: the padded static-buffer step a replay computes runs eagerly
(`DecodeGraphs.run_eagerly`, the Triton kernels in the interpreter), and the greedy tokens must
equal the eager engine's, prompts that share a cached prefix and a prompt too long for the
largest graph included. On a GPU tests/test_cuda_path.py captures the graphs for real."""

from __future__ import annotations

import pytest
import test_spec_decode
import torch

from engine.attention.metadata import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec_graphs import prefill_rows_fit, row_keys

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU stand-in for graphs")
copy_llama_dir = test_spec_decode.copy_llama_dir  # a fixture: a 64-token vocabulary repeats
MAX_SEQS = 24  # the largest graph: 24 rows
PROMPTS = [
    [1, *range(5, 24)],  # 20 tokens: 20 rows
    [1, *range(5, 20), 40, 41, 42, 43, 44],  # its first 16 tokens the first's, one cached
    # block (block size 16): a chunk of 5 rows over them
    [1, *range(20, 60)],  # 41 tokens: more than the largest graph, run eagerly
]


def _meta(starts: list[int], lens: list[int], num_prefills: int) -> AttentionMetadata:
    n = len(lens)
    return AttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=starts[num_prefills],
        num_decodes=n - num_prefills, slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.zeros(n, 4, dtype=torch.int32), query_start_loc_cpu=starts,
        seq_lens_cpu=lens, max_seq_len=max(lens), block_size=16)


def test_the_rows_keys_and_the_limits() -> None:
    # a chunk of 3 tokens ending at length 10 (rows of 8, 9, 10 keys), a decode at length 5
    meta = _meta([0, 3, 4], [10, 5], num_prefills=1)
    assert row_keys(meta) == 8 + 9 + 10 + 5
    assert prefill_rows_fit(meta, max_rows=4, max_keys=32)
    assert not prefill_rows_fit(meta, max_rows=3, max_keys=32)  # 4 tokens, 3 rows at most
    assert not prefill_rows_fit(meta, max_rows=4, max_keys=31)
    assert not prefill_rows_fit(meta, max_rows=4, max_keys=0)  # off


def _llm(path: str) -> LLM:
    return LLM(path, dtype="float32", device="cpu", attention_backend="triton",
               max_model_len=256, max_num_seqs=MAX_SEQS, kv_cache_memory=16 << 20, seed=0)


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, max_tokens: int = 6
            ) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = []
    for prompt in prompts:  # one at a time: each prompt's chunk a step of its own
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        outs.append(list(out.outputs[0].token_ids))
    return outs


def _stand_in(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> tuple[DecodeGraphs, list[int]]:
    """`llm`'s runner given the graphs a GPU would capture, run eagerly; returns them and
    the rows of every step they served that had a prompt's chunk."""
    monkeypatch.setattr(DecodeGraphs, "capture", DecodeGraphs.run_eagerly)
    runner = llm.llm_engine.runner
    runner.graphs = graphs = runner._make_graphs()
    rows: list[int] = []
    real = graphs.run

    def run(input_ids, positions, meta):
        if input_ids.shape[0] > 1 and int(meta.seq_lens.min()) < int(meta.seq_lens.max()):
            rows.append(meta.num_decodes)  # rows of differing lengths: a chunk's
        return real(input_ids, positions, meta)

    monkeypatch.setattr(graphs, "run", run)
    return graphs, rows


def test_prompts_replayed_as_rows_give_the_eager_tokens(
        copy_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _tokens(_llm(copy_llama_dir))
    monkeypatch.setattr(DecodeGraphs, "row_keys_max", 1 << 18)
    llm = _llm(copy_llama_dir)
    graphs, rows = _stand_in(llm, monkeypatch)
    assert _tokens(llm) == want
    # the first prompt whole, the second's 5 uncached tokens; the 41 tokens ran eagerly
    assert rows == [20, 5]
    assert graphs.row_replays == 2


def test_no_rows_when_their_keys_are_capped_at_zero(
        copy_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DecodeGraphs, "row_keys_max", 0)  # PDSERVE_GRAPH_ROW_KEYS=0
    llm = _llm(copy_llama_dir)
    graphs, rows = _stand_in(llm, monkeypatch)
    _tokens(llm, PROMPTS[:1], max_tokens=2)  # 20 tokens would fit the largest graph
    assert rows == [] and graphs.row_replays == 0
    assert graphs.replays > 0  # the decode steps still replay

