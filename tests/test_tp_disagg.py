"""Disaggregation between workers of different tensor parallelism: a push carries every KV head
(rank 0 reads every rank's shard, engine/distributed/kv_shards.py) and the receiving worker's
rank 0 writes each head into the ranks that own it. Prefill TP=2 -> decode TP=1 and prefill
TP=1 -> decode TP=2 equal the colocated TP=1 engine token for token."""

from __future__ import annotations

import pytest
from test_disagg_engine import run_all

from engine.kv_transfer import KVSlabWriter, layout_of, read_slabs
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from pdserve import SamplingParams

PROMPTS = ["A prompt that spans several blocks of sixteen tokens each, to cross block edges " * 2,
           "Short one", "Exactly as long as it needs to be, no more and no less."]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(model: str, role: str, tp: int) -> LLMEngine:
    return LLMEngine(build_engine_config(model, device="cpu", role=role, num_kv_blocks=48,
                                         tensor_parallel_size=tp))


def _split(prefill: LLMEngine, decode: LLMEngine, max_bytes: int, prompts: list = PROMPTS,
           params: SamplingParams = PARAMS) -> list[list[int]]:
    """Each prompt prefilled on `prefill`, its KV moved in slabs of at most `max_bytes` into
    the blocks `decode` reserved, then decoded there: the tokens, in prompt order."""
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, params)
    firsts = run_all(prefill)
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        reserved = decode.reserve_request(rid, p, params).block_ids
        writer = KVSlabWriter(decode.runner.kv_view(), reserved)
        for slab in read_slabs(prefill.runner.kv_view(), prefill.held_block_ids(rid), max_bytes):
            writer.write(slab)
        assert writer.complete
        assert prefill.release(rid)
        decode.commit_request(rid, firsts[rid].outputs[0].token_ids[0], None)
    outs = run_all(decode)  # the first token, sampled by the prefill worker, included
    return [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_split_across_tp_sizes_equals_colocated(prefill_tp, decode_tp, tiny_llama_dir):
    colocated = _engine(tiny_llama_dir, "colocated", 1)
    for i, p in enumerate(PROMPTS):
        colocated.add_request(f"r{i}", p, PARAMS)
    expected = [out.outputs[0].token_ids for _, out in sorted(run_all(colocated).items())]
    prefill = _engine(tiny_llama_dir, "prefill", prefill_tp)
    decode = _engine(tiny_llama_dir, "decode", decode_tp)
    try:
        # both see all 2 KV heads, whichever ranks hold them
        assert layout_of(prefill.runner.kv_view()) == layout_of(decode.runner.kv_view())
        assert layout_of(decode.runner.kv_view()).num_kv_heads == 2
        assert _split(prefill, decode, max_bytes=3000) == expected  # slabs of block pieces
    finally:
        prefill.shutdown()
        decode.shutdown()
