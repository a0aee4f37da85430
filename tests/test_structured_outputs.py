"""Structured outputs (engine/structured/): the sampler never lets a token outside the grammar's
bitmask through, in any sampling mode; the bundled model's sampled outputs parse and validate
against JSON schemas, regexes, choices and EBNF grammars; bad constraints are a ValueError with
the compiler's message; the constraint holds across the prefill/decode split and a resume."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch
from test_structured_bitmask import V, _bitmask

from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import allowed_tokens
from engine.structured.params import StructuredOutputsParams
from pdserve import LLM

MODES = [
    dict(temperature=0.0),
    dict(temperature=0.0, logprobs=3),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.2, top_p=0.5),
    dict(temperature=1.0, min_p=0.2, seed=3),
    dict(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                 "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


def test_bitmask_unpacks_to_exactly_the_allowed_tokens():
    sets = [{0, 31, 32, 1499}, set(range(V))]
    allowed = allowed_tokens(_bitmask(sets), V)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in allowed] == sets


@pytest.mark.parametrize("mode", MODES, ids=[",".join(map(str, m.items())) for m in MODES])
def test_sampler_never_leaves_the_bitmask(mode):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, V, generator=gen) * 3
    sets = [set(torch.randperm(V, generator=gen)[: 1 + r % 7].tolist()) for r in range(64)]
    # the unconstrained favourite is never among the allowed: masking must bite
    for r, s in enumerate(sets):
        s.discard(int(logits[r].argmax()))
        s.add(int(logits[r].argsort()[-50 - r]))
    rows = [SamplingRow(SamplingParams(**mode), [1, 2], [3], frozenset({2}),
                        torch.Generator().manual_seed(7) if "seed" in mode else None)
            for _ in range(64)]
    out = Sampler()(logits, rows, torch.Generator().manual_seed(1), _bitmask(sets))
    assert all(t in s for t, s in zip(out.token_ids, sets))
    if mode.get("logprobs"):
        for (chosen, top), s in zip(out.logprobs, sets):
            # from the constrained distribution: a disallowed token has probability 0 (it
            # shows only when fewer tokens are allowed than logprobs asked for)
            assert all(lp == -math.inf for t, lp in top.items() if t not in s)
            assert math.log(1.0) >= chosen > -math.inf
            probs = sum(math.exp(lp) for lp in top.values())
            assert probs <= 1.0 + 1e-5


@pytest.fixture(scope="module")
def llm(bundled_path):
    # fp32, de-quantized: the seeded samples below are this model's (the default keeps the GGUF
    # quantized, whose samples differ)
    return LLM(bundled_path, device="cpu", dtype="float32", max_model_len=1024,
               kv_cache_memory=64 << 20)


def _texts(llm, so: StructuredOutputsParams, n: int, max_tokens: int = 120, **kw) -> list:
    chats = [[{"role": "user", "content": "Describe a user of our web site as JSON."}]] * n
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, structured_outputs=so,
                             **kw) for i in range(n)]
    return [o.outputs[0] for o in llm.chat(chats, params, use_tqdm=False)]


def test_json_schema_outputs_validate_on_20_sampled_requests(llm):
    outs = _texts(llm, StructuredOutputsParams(json=SCHEMA), 20)
    assert len({o.text for o in outs}) > 1  # sampled, not one greedy answer
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_json_object_regex_choice_and_grammar(llm):
    for o in _texts(llm, StructuredOutputsParams(json_object=True), 3):
        assert isinstance(json.loads(o.text), dict)
    for o in _texts(llm, StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} [0-9]{3}"), 3):
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{3}", o.text), o.text
    choices = ["red", "green", "blue sky"]
    assert {o.text for o in _texts(llm, StructuredOutputsParams(choice=choices), 6)} <= set(choices)
    grammar = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,6} "!"'
    for o in _texts(llm, StructuredOutputsParams(grammar=grammar), 3, max_tokens=30):
        assert re.fullmatch(r"(hello|hi) [a-z]{1,6}!", o.text), o.text


def test_a_grammar_that_cannot_finish_in_time_ends_with_length(llm):
    (o,) = _texts(llm, StructuredOutputsParams(json=SCHEMA), 1, max_tokens=5)
    assert o.finish_reason == "length" and len(o.token_ids) == 5


@pytest.mark.parametrize("so,message", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
     "structured_outputs.json does not compile"),
    (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex does not compile"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"),
     "structured_outputs.grammar does not compile"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json does not compile"),
])
def test_bad_constraints_are_value_errors_and_queue_nothing(llm, so, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["hi"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_structured_params_are_validated():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    so = StructuredOutputsParams(json=SCHEMA)
    assert StructuredOutputsParams.from_spec(so.kind, so.spec()).spec() == so.spec()


def test_split_and_resume_keep_the_constraint(bundled_path):
    """Prefill samples the first token under the grammar, decode rebuilds the matcher from the
    tokens so far; a request resumed with prior tokens goes on from there."""
    from test_disagg_engine import disaggregated, run_all

    def make(role: str, **kw) -> LLMEngine:
        return LLMEngine(build_engine_config(bundled_path, device="cpu", role=role,
                                             max_model_len=512, num_kv_blocks=64, **kw))

    colocated, prefill, decode = make("colocated"), make("prefill"), make("decode")
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    prompts = [colocated.tokenizer.encode("A user as JSON:")]
    colocated.add_request("c", prompts[0], params)
    expected = run_all(colocated)["c"].outputs[0].token_ids
    split = disaggregated(prefill, decode, prompts, params)[0]
    assert split[1:] == expected  # disaggregated() prepends the prefill's first token
    # resumed after 7 tokens, elsewhere: the same continuation
    colocated.add_request("r", prompts[0], params, prior_output_token_ids=expected[:7])
    assert run_all(colocated)["r"].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="does not follow the grammar"):
        colocated.add_request("bad", prompts[0], params, prior_output_token_ids=[0])


def test_overlapped_steps_constrain_exactly_as_serial_steps(llm, bundled_path):
    """With asynchronous scheduling a constrained step's sampling waits for the step before
    to be appended (its forward runs meanwhile): outputs equal steps run one at a time."""
    serial = LLM(bundled_path, device="cpu", dtype="float32", max_model_len=1024,
                 kv_cache_memory=64 << 20, async_scheduling=False)
    so = StructuredOutputsParams(json=SCHEMA)
    overlapped = [o.token_ids for o in _texts(llm, so, 4)]
    assert overlapped == [o.token_ids for o in _texts(serial, so, 4)]
    assert llm.llm_engine._overlap and not serial.llm_engine._overlap


def test_grammar_compiles_cache_hits_and_bitmask_time_are_exported(llm):
    from pdserve.cluster.worker import WorkerMonitor, _StatsCollector

    s = llm.llm_engine.stats()  # after the tests above on this engine
    assert s.grammar_compiles >= 4 and s.grammar_cache_hits >= 20
    assert s.grammar_compile_seconds > 0 and s.grammar_bitmask_seconds > 0
    monitor = WorkerMonitor("decode", "127.0.0.1:1", engine=None, stats=s)  # type: ignore[arg-type]
    exported = {m.name: m.samples[0].value for m in _StatsCollector(monitor).collect()
                if m.samples}  # a labelled family may have none yet
    assert exported["pdserve:grammar_compiles"] == s.grammar_compiles
    assert exported["pdserve:grammar_compile_cache_hits"] == s.grammar_cache_hits
    assert exported["pdserve:grammar_bitmask_seconds"] == s.grammar_bitmask_seconds


INTS = {"type": "array", "items": {"type": "integer"}, "minItems": 16}  # cannot end in 8 tokens


def test_a_landed_step_fills_the_next_steps_mask_before_its_outputs(tiny_llama_dir):
    """Overlapping steps: when step N's tokens land they are appended (the matchers advance),
    then step N+1's bitmask is filled and its sampling queued, and only then are N's text and
    outputs made; each mask sees its matchers exactly one token per landed step further."""
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=64 << 20)
    engine, events = llm.llm_engine, []
    manager = engine.structured()
    fill, process_text = manager.bitmask, engine._process_text

    def bitmask(matchers):
        events.append(("mask", sorted(len(s.req.output_token_ids)
                                      for g in engine._groups.values() for s in g.seqs)))
        return fill(matchers)

    def text(group):
        events.append(("text", [len(s.req.output_token_ids) for s in group.seqs]))
        process_text(group)

    manager.bitmask, engine._process_text = bitmask, text
    # a stop string that never matches: the text is made every step (final-only output without
    # one is detokenized once, at the end)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["\u00a7\u00a7"],
                            structured_outputs=StructuredOutputsParams(json=INTS))
    outs = llm.generate(["[1, 2", "numbers:"], params, use_tqdm=False)
    assert engine._overlap and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    masks = [e for e in events if e[0] == "mask"]
    assert [n for _, n in masks] == [[k, k] for k in range(8)]  # N+1's mask: N appended
    for k in range(1, 8):  # step k's mask comes before the text of the step that landed
        assert events.index(("mask", [k, k])) < events.index(("text", [k]))


def test_matcher_termination_is_xgrammars_through_accepts_and_rollbacks(bundled_tokenizer):
    from engine.structured.manager import StructuredOutputs

    tok = bundled_tokenizer
    eos = tok.eos_token_id
    manager = StructuredOutputs.for_tokenizer(tok, len(tok), frozenset({eos}))
    m = manager.matcher(manager.compile(StructuredOutputsParams(choice=["red", "blue"])), [])
    for token in tok.encode("red"):
        assert m.accept(token) and not m.is_terminated()
    assert not m.accept(tok.encode("x")[0]) and not m.is_terminated()  # refused: unchanged
    assert m.accept(eos) and m.is_terminated() and m._m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and not m._m.is_terminated()
    assert m.accept(eos) and m.is_terminated()


def test_step_bitmask_fills_whole_rows_and_frees_the_others(bundled_tokenizer):
    """One backend call fills the live rows of an uninitialised buffer; unconstrained rows and
    finished grammars' rows allow everything; equal to the per-row fill."""
    from engine.structured.manager import StructuredOutputs

    tok = bundled_tokenizer
    eos = tok.eos_token_id
    manager = StructuredOutputs.for_tokenizer(tok, len(tok) + 5, frozenset({eos}))
    compiled = manager.compile(StructuredOutputsParams(json=INTS))
    live = [manager.matcher(compiled, tok.encode(p)) for p in ("[12, 3", "[4")]
    done = manager.matcher(manager.compile(StructuredOutputsParams(choice=["ok"])),
                           tok.encode("ok") + [eos])
    for _ in range(3):  # fresh buffers hold whatever the allocator had
        mask = manager.bitmask([live[0], None, done, live[1]])
        expected = torch.full_like(mask, -1)
        live[0].fill_bitmask(expected, 0)
        live[1].fill_bitmask(expected, 3)
        assert torch.equal(mask, expected)
        assert mask[0].ne(-1).any() and mask[3].ne(-1).any()
