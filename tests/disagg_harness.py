"""Prefill/decode (P/D) disaggregation inside one process, shared by the tests that compare it
with the colocated engine: a prefill-role engine runs the prompts and exports their KV as slabs,
a decode-role engine reserves blocks, takes the slabs and the first token, and continues.

    pd_engines                   colocated, prefill and decode engines on one model
    run_all                      step an engine until it has no work; the finished outputs
    disaggregated                prompts through prefill -> KV slabs -> decode
    colocated_and_disaggregated  PD_PROMPTS' greedy tokens both ways, for the tests to compare
"""

from __future__ import annotations

from engine.kv_transfer import KVSlabWriter, read_slabs
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from pdserve import SamplingParams

PD_PROMPTS = (
    "A prompt that spans several blocks of sixteen tokens each, to cross block edges " * 2,
    "Short one",
    "Exactly as long as it needs to be, no more and no less.",
)


def pd_engines(
    model_dir: str, num_kv_blocks: int | None = None, decode_kv_blocks: int = 40, **kw
) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    """(colocated, prefill, decode) float32 engines on `model_dir`, with the engine options `kw`;
    the colocated and prefill ones hold `num_kv_blocks` (None: sized from memory), the decode
    one `decode_kv_blocks`."""

    def make(role: str, **more) -> LLMEngine:
        return LLMEngine(build_engine_config(model_dir, dtype="float32", role=role, **kw, **more))

    sized = {} if num_kv_blocks is None else {"num_kv_blocks": num_kv_blocks}
    return make("colocated", **sized), make("prefill", **sized), \
        make("decode", num_kv_blocks=decode_kv_blocks)


def run_all(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params, max_bytes=4 << 20):
    """Each prompt's tokens: prefilled on `prefill`, its KV moved in slabs of at most
    `max_bytes` into `decode`'s reserved blocks (those its prefix cache holds skipped), then
    decoded. The decode outputs repeat the imported first token: [first, first, second, ...].
    Frees every prefill block."""
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, params)
    firsts = run_all(prefill)
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        first = firsts[rid].outputs[0]
        dst = decode.reserve_request(rid, p, params)
        skip = dst.num_cached_blocks  # the decode engine's prefix cache holds those
        writer = KVSlabWriter(decode.runner.kv_caches, dst.block_ids, present=skip)
        for slab in read_slabs(prefill.runner.kv_caches, prefill.held_block_ids(rid), max_bytes,
                               skip):
            writer.write(slab)
        assert writer.complete
        assert prefill.release(rid)
        decode.commit_request(rid, first.token_ids[0], None)
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    outs = run_all(decode)
    return [firsts[f"r{i}"].outputs[0].token_ids[:1] + outs[f"r{i}"].outputs[0].token_ids
            for i in range(len(prompts))]


def colocated_and_disaggregated(
    colocated: LLMEngine, prefill: LLMEngine, decode: LLMEngine, max_bytes: int
) -> tuple[list[list[int]], list[list[int]]]:
    """PD_PROMPTS' 12 greedy tokens each: (colocated, `disaggregated` with slabs of at most
    `max_bytes`)."""
    tok = colocated.tokenizer
    prompts = [tok.encode(t) for t in PD_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        colocated.add_request(f"c{i}", p, params)
    ref = run_all(colocated)
    expected = [ref[f"c{i}"].outputs[0].token_ids for i in range(len(prompts))]
    return expected, disaggregated(prefill, decode, prompts, params, max_bytes)
