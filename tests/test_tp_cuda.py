"""Tensor parallelism on CUDA GPUs (needs 2; skipped otherwise): TP=2 gives TP=1's greedy tokens
in fp32, from CUDA graphs whose NCCL all-reduces were captured with them (the default) and
eagerly (`enforce_eager`), both within one engine and across a split (prefill TP=2 -> decode TP=1,
and the reverse), where each worker's rank 0 moves every rank's KV heads."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

from conftest import _save_tiny  # noqa: E402
from test_cuda_path import prompts  # noqa: E402
from test_disagg_engine import run_all  # noqa: E402
from test_tp_disagg import _split  # noqa: E402

from engine.llm import build_engine_config  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from pdserve import LLM, SamplingParams  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_llama_dir(tmp_path_factory, bundled_tokenizer) -> str:
    """A random Llama whose 8 query and 2 KV heads split over 2 ranks; untied lm_head."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(bundled_tokenizer), hidden_size=512, intermediate_size=1536,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, rope_theta=100000.0, initializer_range=0.1,
    )
    return _save_tiny(cfg, bundled_tokenizer, tmp_path_factory.mktemp("tp_llama"))


@pytest.fixture(autouse=True)
def _gpu_freed() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_tp2_matches_tp1(tp_llama_dir, graphs):
    batch = prompts(n=8, seed=2)
    kwargs = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=512,
                  gpu_memory_utilization=0.2)
    one = LLM(tp_llama_dir, **kwargs)
    expected = _greedy(one, batch)
    one.llm_engine.shutdown()
    del one
    gc.collect()
    two = LLM(tp_llama_dir, tensor_parallel_size=2, enforce_eager=not graphs, **kwargs)
    try:
        runner = two.llm_engine.runner
        assert runner.tp.world_size == 2 and (runner.graphs is not None) == graphs
        assert _greedy(two, batch) == expected
        if graphs:  # decode steps replayed on both ranks
            assert runner.graphs.replays > 0
    finally:
        two.llm_engine.shutdown()


def _engine(model: str, role: str, tp: int) -> LLMEngine:
    return LLMEngine(build_engine_config(model, device="cuda", role=role, dtype="float32",
                                         num_kv_blocks=256, max_num_seqs=8,
                                         tensor_parallel_size=tp))


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_split_across_tp_sizes_on_gpus_equals_colocated(tp_llama_dir, prefill_tp, decode_tp):
    batch = prompts(n=4, seed=3)
    colocated = _engine(tp_llama_dir, "colocated", 1)
    for i, p in enumerate(batch):
        colocated.add_request(f"r{i}", p, PARAMS)
    expected = [list(out.outputs[0].token_ids) for _, out in sorted(run_all(colocated).items())]
    colocated.shutdown()
    prefill = _engine(tp_llama_dir, "prefill", prefill_tp)
    decode = _engine(tp_llama_dir, "decode", decode_tp)
    try:
        got = _split(prefill, decode, 1 << 20, batch, PARAMS)
        assert [list(tokens) for tokens in got] == expected
    finally:
        prefill.shutdown()
        decode.shutdown()
