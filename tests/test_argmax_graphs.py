"""Greedy decode steps whose tokens an argmax graph picks (engine/cuda_graphs.py `run_argmax`):
the forward, the logits and their argmax in one replay.

On the CPU no graph is captured: the padded static-buffer step a replay computes runs eagerly
(`DecodeGraphs.run_eagerly`) on the Triton kernels in the interpreter. Either way the tokens
must equal those of an engine without graphs, and only steps whose every row is plain greedy
may take the argmax graph."""

from __future__ import annotations

import pytest
import test_spec_decode
import torch

from engine.cuda_graphs import DecodeGraphs
from engine.llm import LLM
from engine.sampling_params import SamplingParams

copy_llama_dir = test_spec_decode.copy_llama_dir  # a fixture: a tiny Llama, 64-token vocabulary
CUDA = torch.cuda.is_available()
PROMPTS = [[1, 5, 6, 7, 8] * 4, [1, 30, 17, 40, 23, 58, 9], [1, 3]]  # 3 rows: padded to 4


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(path, dtype="float32", device="cuda" if CUDA else "cpu",
               attention_backend="triton", max_model_len=256, kv_cache_memory=16 << 20,
               seed=0, **kwargs)


def _graphs(llm: LLM, monkeypatch) -> DecodeGraphs:
    """`llm`'s decode graphs: captured on a GPU, on the CPU the same steps run eagerly."""
    runner = llm.llm_engine.runner
    if not CUDA:
        monkeypatch.setattr(DecodeGraphs, "capture", DecodeGraphs.run_eagerly)
        runner.graphs = runner._make_graphs()
    assert runner.graphs is not None
    return runner.graphs


def _generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy(max_tokens: int = 10, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_greedy_steps_take_their_tokens_from_the_argmax_graph(copy_llama_dir, monkeypatch):
    want = _generate(_llm(copy_llama_dir, enforce_eager=True), [_greedy()] * 3)
    llm = _llm(copy_llama_dir)
    graphs = _graphs(llm, monkeypatch)
    assert _generate(llm, [_greedy()] * 3) == want
    # every decode step but those where a row finished early took the argmax graph
    assert graphs.argmax_replays > 0 and graphs.argmax_replays == graphs.replays


def test_rows_needing_more_than_the_argmax_keep_the_sampler(copy_llama_dir, monkeypatch):
    """A row with logprobs, a penalty, min_tokens still to reach, or a sampled row: the step
    replays the plain graph and the sampler picks every row's token."""
    params = [_greedy(logprobs=2), _greedy(repetition_penalty=1.3),
              SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=5)]
    want = _generate(_llm(copy_llama_dir, enforce_eager=True), params)
    llm = _llm(copy_llama_dir)
    graphs = _graphs(llm, monkeypatch)
    assert _generate(llm, params) == want
    assert graphs.replays > 0 and graphs.argmax_replays == 0
    # min_tokens: the argmax graph only once the row may stop
    llm = _llm(copy_llama_dir)
    graphs = _graphs(llm, monkeypatch)
    out = _generate(llm, [_greedy(12, min_tokens=8)] * 3)
    assert out == _generate(_llm(copy_llama_dir, enforce_eager=True),
                            [_greedy(12, min_tokens=8)] * 3)
    assert 0 < graphs.argmax_replays < graphs.replays


def test_argmax_graphs_can_be_turned_off(copy_llama_dir, monkeypatch):
    monkeypatch.setattr(DecodeGraphs, "argmax_max_batch", 0)
    llm = _llm(copy_llama_dir)
    graphs = _graphs(llm, monkeypatch)
    _generate(llm, [_greedy(4)] * 3)
    assert graphs.replays > 0 and graphs.argmax_replays == 0 and not graphs.argmax_graphs


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_argmax_graphs_are_captured_for_the_small_sizes_only(copy_llama_dir):
    graphs = _graphs(_llm(copy_llama_dir, max_num_seqs=32), None)
    assert sorted(graphs.argmax_graphs) == [s for s in graphs.sizes
                                            if s <= DecodeGraphs.argmax_max_batch]
    assert len(graphs.sizes) > len(graphs.argmax_graphs)
