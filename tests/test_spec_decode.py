"""Speculative decoding with n-gram (prompt lookup) drafts: config, proposer, rejection sampler,
block rollback, and end to end the same outputs as without speculation.

End-to-end cases use a tiny random Llama with a 64-token vocabulary: its greedy output soon
repeats itself, so n-gram drafts are accepted (each case asserts that they were, so that none
passes vacuously).
"""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from engine.request import Request, RequestStatus
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerStats
from engine.spec_decode.ngram import NgramProposer, propose_ngram
from engine.spec_decode.rejection import verify
from pdserve import LLM

BS = 16
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


# ---- config -----------------------------------------------------------------------------------
def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 3},
            "prompt_lookup_min",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "prompt_lookup_max",
        ),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown keys \\['lookahead'\\]"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            "speculative_config.model .* is required",
        ),
        (
            {"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "ngram method only",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not implemented"),
        ({"method": "magic", "num_speculative_tokens": 2}, "method must be one of"),
    ],
)
def test_config_errors_name_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)


def test_engine_config_refuses_tensor_parallel_speculation():
    spec = SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig("m", speculative=spec, parallel=ParallelConfig(tensor_parallel_size=2))


# ---- proposer ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 3, [4, 5, 9]),
        # the longest match wins over a more recent shorter one
        ([1, 2, 3, 7, 9, 3, 8, 1, 2, 3], 1, 3, 2, [7, 9]),
        # equal lengths: the most recent
        ([5, 6, 1, 5, 6, 2, 5, 6], 2, 2, 1, [2]),
        # matches longer than max_n count as max_n: recency decides ...
        ([1, 2, 3, 4, 50, 0, 3, 4, 60, 1, 2, 3, 4], 1, 2, 1, [60]),
        # ... and with a larger max_n the longer match wins
        ([1, 2, 3, 4, 50, 0, 3, 4, 60, 1, 2, 3, 4], 1, 4, 1, [50]),
        # no earlier occurrence of a min_n-token suffix
        ([1, 2, 3, 4, 9, 4], 2, 3, 3, []),
        ([1, 2, 3], 1, 3, 3, []),
        ([7], 1, 1, 3, []),
        # the continuation stops at the end of the sequence
        ([7, 7, 7], 1, 1, 3, [7]),
        ([1, 2, 1, 2, 1], 1, 3, 5, [2, 1]),
    ],
)
def test_ngram_proposals(tokens, min_n, max_n, k, expected):
    assert propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k) == expected


def test_proposer_follows_appended_tokens():
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    )
    req = Request("r", [10, 11, 12, 13, 10], SamplingParams())
    assert proposer.propose(req) == [11, 12]
    req.output_token_ids += [11, 12, 40]  # 40 never seen before
    assert proposer.propose(req) == []
    req.output_token_ids += list(range(41, 120)) + [13]  # past the buffer's first size
    assert proposer.propose(req) == [10, 11]
    proposer.forget("r")
    assert proposer._buffers == {}


# ---- rejection sampler ------------------------------------------------------------------------
def reference_probs(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """Slow, obvious: temperature, top-k (renormalised), top-p, min-p on one row, normalised."""
    probs = torch.softmax(logits.double() / p.temperature, -1).numpy()
    order = np.argsort(-probs, kind="stable")
    if p.top_k > 0:
        probs[order[p.top_k :]] = 0.0
        probs /= probs.sum()
    mass = 0.0
    for t in order:
        if mass >= p.top_p:
            probs[t] = 0.0
        mass += probs[t]
    probs /= probs.sum()
    probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square at p = 0.001


def assert_distributed_as(samples: list[int], expected: np.ndarray) -> None:
    counts = np.bincount(samples, minlength=len(expected))
    assert counts[expected == 0].sum() == 0, (counts, expected)
    nz = expected > 0
    want = expected[nz] * len(samples)
    chi2 = float(((counts[nz] - want) ** 2 / want).sum())
    if nz.sum() > 1:
        assert chi2 < CHI2_999[int(nz.sum()) - 1], (chi2, counts, want)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.15),
    ],
)
def test_rejection_sampler_keeps_the_target_distribution(params):
    """20k seeded verifications of drafts [d0, d1]: the first emitted token is distributed as p0,
    the second (after an accepted d0) as p1, the third (both accepted) as p2 — whatever the
    drafts' own probabilities, including a draft the target never samples."""
    vocab, n = 6, 20_000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * 1.5  # positions 0, 1, 2
    p = [reference_probs(logits[j], params) for j in range(3)]
    d0 = int(np.argsort(p[0])[-2])  # the second most likely
    d1 = int(np.argmin(p[1]))  # the least likely: maybe outside top-k/p
    rows = [SamplingRow(params, [1], [], frozenset()) for _ in range(3 * n)]
    out = verify(logits.repeat(n, 1), rows, [[d0, d1]] * n, gen)
    firsts = [e[0][0] for e in out]
    assert_distributed_as(firsts, p[0])
    seconds = [e[1][0] for e in out if e[0][0] == d0]
    assert abs(len(seconds) / n - p[0][d0]) < 0.02
    assert_distributed_as(seconds, p[1])
    thirds = [e[2][0] for e in out if len(e) == 3]
    assert all(e[1][0] == d1 for e in out if len(e) == 3)
    if p[1][d1] > 0.02:
        assert_distributed_as(thirds, p[2])
    assert all(len(e) == 3 or e[-1][0] != [d0, d1][len(e) - 1] for e in out)


def test_greedy_verification_accepts_while_the_draft_is_the_argmax():
    logits = torch.full((3, 8), -1.0)
    logits[0, 3] = logits[1, 1] = logits[2, 4] = 2.0
    greedy = SamplingParams(temperature=0)
    rows = [SamplingRow(greedy, [1], [], frozenset())] * 3
    tokens = [[t for t, _ in e] for e in verify(logits, rows, [[3, 2]])]
    assert tokens == [[3, 1]]
    assert [[t for t, _ in e] for e in verify(logits, rows, [[3, 1]])] == [[3, 1, 4]]
    assert [[t for t, _ in e] for e in verify(logits, rows, [[0, 1]])] == [[3]]


def test_verification_logprobs_and_per_position_penalties():
    """Row j sees drafts before it as output: a repetition penalty on draft 3 turns row 1's
    argmax to token 5; logprobs are of the raw logits at each emitted position."""
    logits = torch.zeros(2, 8)
    logits[:, 3], logits[:, 5] = 3.0, 2.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=1)
    rows = [SamplingRow(params, [1], [], frozenset()), SamplingRow(params, [1], [3], frozenset())]
    (emitted,) = verify(logits, rows, [[3]])
    assert [t for t, _ in emitted] == [3, 5]
    raw = torch.log_softmax(logits[0], -1)
    assert emitted[0][1][0] == pytest.approx(float(raw[3]))
    assert emitted[1][1][0] == pytest.approx(float(raw[5]))
    assert list(emitted[1][1][1]) == [3]  # the raw top-1, before the penalty


def test_seeded_verification_ignores_the_rest_of_the_batch():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=5)

    def run(with_others: bool) -> list:
        gen = torch.Generator().manual_seed(5)
        rows = [SamplingRow(seeded, [1], [], frozenset(), generator=gen)] * 3
        logit_rows, drafts = logits, [[2, 7]]
        if with_others:
            other = SamplingRow(SamplingParams(temperature=1.0), [1], [], frozenset())
            rows = [other] * 2 + rows
            logit_rows, drafts = torch.cat([logits[:2], logits]), [[4], [2, 7]]
        return [verify(logit_rows, rows, drafts)[-1] for _ in range(1)]

    assert run(False) == run(True)


# ---- block manager and scheduler --------------------------------------------------------------
def make_req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), max_tokens=params.get("max_tokens", 16))


def test_rollback_slots_frees_the_tail_blocks_front_first():
    bm = BlockManager(num_blocks=11, block_size=BS)
    a = make_req("a", list(range(30)))
    assert bm.allocate_slots(a, 50)  # 30 tokens + 20 draft slots
    assert a.block_ids == [0, 1, 2, 3]
    a.num_computed_tokens = 33
    bm.rollback_slots(a, 33)
    assert a.block_ids == [0, 1, 2]
    assert list(bm._free) == [3, 4, 5, 6, 7, 8, 9, 10]
    bm.rollback_slots(a, 32)
    assert a.block_ids == [0, 1] and list(bm._free)[:3] == [2, 3, 4]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 0]
    bm.rollback_slots(a, 32)  # nothing past the kept blocks: a no-op
    assert a.block_ids == [0, 1] and bm.num_free_blocks == 9


def test_rollback_slots_refuses_shared_or_cached_blocks():
    bm = BlockManager(num_blocks=11, block_size=BS)
    a = make_req("a", list(range(40)))
    assert bm.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    bm.cache_full_blocks(a)  # blocks 0, 1 registered
    with pytest.raises(ValueError, match="block 1"):
        bm.rollback_slots(a, 16)
    assert a.block_ids == [0, 1, 2] and bm.num_free_blocks == 8  # unchanged


def drive(sched: Scheduler, samples: dict) -> list[Request]:
    out = sched.schedule()
    return sched.update_from_output(out, samples), out


def test_rejected_drafts_roll_back_to_a_run_without_them():
    """Drafts [a, b, c] after the prompt's first token, only `a` accepted then x emitted: the
    block table, computed tokens, registered hashes and free queue equal those of a run that
    appended the same tokens one step at a time. The block that held the rejected `b` (position
    31's slot, completing block 1) is registered only once x's K/V is there."""
    prompt = list(range(100, 130))  # 30 tokens
    runs = []
    for speculate in (True, False):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(11, BS))
        req = make_req("r", prompt, max_tokens=8)
        sched.add_request(req)
        drive(sched, {"r": (7, None)})  # prefill: first token 7
        if speculate:
            req.spec_token_ids = [8, 9, 10]
            out = sched.schedule()
            (s,) = out.scheduled
            assert (s.num_new_tokens, s.spec_token_ids, req.block_ids) == (4, [8, 9, 10], [0, 1, 2])
            sched.update_from_output(out, {"r": [(8, None), (11, None)]})
            assert req.block_ids == [0, 1] and req.num_computed_tokens == 32
            stats = sched.stats()
            assert stats.spec_decode_num_accepted_tokens == 1
            assert stats.spec_decode_num_accepted_tokens_per_pos == (1, 0, 0)
        else:
            drive(sched, {"r": (8, None)})
            drive(sched, {"r": (11, None)})
        bm = sched.block_manager
        assert req.output_token_ids == [7, 8, 11]
        assert bm.blocks[1].block_hash is None or not speculate
        drive(sched, {"r": (12, None)})  # computes position 32 (token 11): block 2 again
        runs.append(
            (list(req.block_ids), req.num_computed_tokens, bm.cached_hashes(), list(bm._free))
        )
    assert runs[0] == runs[1]
    assert runs[0][0] == [0, 1, 2] and len(runs[0][2]) == 2


def test_a_stop_token_among_accepted_drafts_ends_the_output_there():
    sched = Scheduler(SchedulerConfig(), BlockManager(11, BS))
    req = make_req("r", list(range(100, 120)), stop_token_ids=[42], max_tokens=16)
    sched.add_request(req)
    drive(sched, {"r": (7, None)})
    req.spec_token_ids = [8, 42, 9]
    fin, out = drive(sched, {"r": [(8, None), (42, None), (9, None), (10, None)]})
    assert fin == [req] and req.output_token_ids == [7, 8, 42]
    assert (req.status, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, 42)
    assert sched.block_manager.num_free_blocks == 11
    s = sched.stats()
    assert (
        s.spec_decode_num_drafts,
        s.spec_decode_num_draft_tokens,
        s.spec_decode_num_accepted_tokens,
    ) == (1, 3, 3)
    assert s.spec_decode_num_accepted_tokens_per_pos == (1, 1, 1)
    assert s.spec_decode_mean_acceptance_length == 4.0


def test_drafts_are_cut_to_max_tokens_and_the_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=3), BlockManager(11, BS))
    req = make_req("r", [1, 2], max_tokens=4)
    sched.add_request(req)
    drive(sched, {"r": (7, None)})
    req.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()  # budget 3: 2 drafts
    assert out.scheduled[0].spec_token_ids == [1, 2] and out.num_batched_tokens == 3
    sched.update_from_output(out, {"r": [(1, None), (2, None), (5, None)]})
    assert req.output_token_ids == [7, 1, 2, 5] and req.status == RequestStatus.FINISHED_LENGTH
    req = make_req("q", [1, 2], max_tokens=3)
    sched.add_request(req)
    drive(sched, {"q": (7, None)})
    req.spec_token_ids = [1, 2, 3]
    out = sched.schedule()  # 2 tokens left: 1 draft and the token after it
    assert out.scheduled[0].spec_token_ids == [1]


def test_worker_metrics_carry_the_spec_counters():
    from pdserve.cluster.worker import WorkerMonitor, _StatsCollector

    class Engine:
        async def stats(self) -> SchedulerStats:
            return SchedulerStats(
                1,
                0,
                3,
                4,
                0.5,
                0,
                0,
                0,
                spec_decode_num_drafts=4,
                spec_decode_num_draft_tokens=12,
                spec_decode_num_accepted_tokens=6,
                spec_decode_num_accepted_tokens_per_pos=(3, 2, 1),
            )

    monitor = WorkerMonitor("decode", "a:1", Engine())
    asyncio.run(monitor.info())
    families = {m.name: m for m in _StatsCollector(monitor).collect()}
    got = {name: m.samples[0].value for name, m in families.items() if m.samples}
    assert got["pdserve:spec_decode_num_drafts"] == 4
    assert got["pdserve:spec_decode_num_draft_tokens"] == 12
    assert got["pdserve:spec_decode_num_accepted_tokens"] == 6
    per_pos = families["pdserve:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 3), ("1", 2), ("2", 1)]


def test_up_hands_the_flag_to_decode_workers_and_the_colocated_engine(monkeypatch):
    import argparse

    from pdserve.cli import build_parser
    from pdserve.launcher import add_arguments, plan

    monkeypatch.delenv("PDSERVE_SPECULATIVE_CONFIG", raising=False)
    monkeypatch.delenv("PDSERVE_COLOCATED", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = parser.parse_args(["--speculative-config", flag])
    got = {
        s.name: build_parser().parse_args(s.argv[3:]).speculative_config
        for s in plan(args, "redis://127.0.0.1:6379/0", None)
        if "-" in s.name
    }
    assert got == {"prefill-0": "", "decode-0": flag}
    (serve,) = plan(parser.parse_args(["--colocated", "--speculative-config", flag]), "", None)
    assert build_parser().parse_args(serve.argv[3:]).speculative_config == flag


# ---- end to end -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def copy_llama_dir(tmp_path_factory, bundled_tokenizer) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=10000.0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("copy_llama")
    AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(path)
    bundled_tokenizer.save_pretrained(path)
    return str(path)


def verify_every_draft(llm):
    """Hold the draft policy of `llm` (an LLM or LLMEngine) at every proposed draft: these
    tests check exactness, which must not hang on which drafts the policy, timing the steps,
    finds worth verifying (tests/test_spec_policy.py tests the policy)."""
    planner = getattr(llm, "llm_engine", llm).planner
    if planner is not None:
        planner.plan = lambda acceptance, proposed, base, cost: list(proposed)
    return llm


def make_llm(path: str, spec: dict | None, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 16 << 20)
    return verify_every_draft(LLM(path, dtype="float32", max_model_len=256,
                                  speculative_config=spec, **kwargs))


@pytest.fixture(scope="module")
def pair(copy_llama_dir):
    return make_llm(copy_llama_dir, NGRAM), make_llm(copy_llama_dir, None)


def prompts_v64(n: int = 5) -> list[dict]:
    rng = random.Random(0)
    out = [[5, 6, 7, 8] * 5, [9]]
    for _ in range(n - 2):
        motif = [rng.randrange(3, 64) for _ in range(rng.randrange(4, 12))]
        out.append(motif * 3 + motif[:2])
    return [{"prompt_token_ids": p} for p in out]


def results(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


def accepted(llm: LLM) -> int:
    return llm.llm_engine.stats().spec_decode_num_accepted_tokens


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_without_speculation(copy_llama_dir, pair, k):
    on = pair[0] if k == 3 else make_llm(copy_llama_dir, {**NGRAM, "num_speculative_tokens": k})
    assert not on.llm_engine._overlap  # speculative steps never overlap
    before = accepted(on)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert results(on, prompts_v64(), params) == results(pair[1], prompts_v64(), params)
    assert accepted(on) > before
    bm = on.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_max_tokens_and_stop_strings_inside_accepted_runs(pair, monkeypatch):
    """Equal outputs when max_tokens or a stop string falls inside a step's accepted tokens;
    stop strings must have cut such a run at least once (the tokens after it dropped)."""
    from engine.output_processor import SequenceState

    on, off = pair
    cuts = []
    cut = SequenceState._cut
    monkeypatch.setattr(SequenceState, "_cut", lambda self, n: (cuts.append(n), cut(self, n)))
    prompts = prompts_v64(3)
    lengths = list(range(1, 15))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    many = [p for p in prompts for _ in lengths]
    assert results(on, many, params * len(prompts)) == results(off, many, params * len(prompts))
    stats = on.llm_engine.stats()
    assert stats.spec_decode_mean_acceptance_length > 1.2
    prompts.append({"prompt_token_ids": [17] * 16})  # answers with a run of one token
    full = results(off, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    cases = [(prompts[-1], full[-1][1][1:n]) for n in range(3, 9)]  # inside the run's drafts
    cases += [(p, r[1][i : i + 2]) for p, r in zip(prompts, full[:-1]) for i in (5, 21)]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        for _, stop in cases
    ]
    batch = [p for p, _ in cases]
    got = results(on, batch, params)
    assert got == results(off, batch, params)
    assert sum(r[3] is not None for r in got) >= len(cases) - 2
    assert cuts


def test_penalties_min_tokens_and_logprobs_per_position(pair):
    on, off = pair
    before = accepted(on)
    params = [
        SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0, max_tokens=32, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=32, min_tokens=20, logprobs=0),
    ]
    prompts = prompts_v64(3)
    for p in params:
        got = on.generate(prompts, p, use_tqdm=False)
        want = off.generate(prompts, p, use_tqdm=False)
        for g, w in zip(got, want):
            (gc,), (wc,) = g.outputs, w.outputs
            assert gc.token_ids == wc.token_ids and gc.finish_reason == wc.finish_reason
            if p.logprobs is None:
                continue
            assert len(gc.logprobs) == len(gc.token_ids)
            for gl, wl in zip(gc.logprobs, wc.logprobs):
                assert gl.keys() == wl.keys()
                assert all(math.isclose(gl[t].logprob, wl[t].logprob, abs_tol=1e-4) for t in gl)
    assert accepted(on) > before


def test_seeded_sampling_is_reproducible_whatever_the_batch(pair):
    on, _ = pair
    prompts = prompts_v64(4)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11, ignore_eos=True)
    alone = results(on, prompts[2:3], seeded)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    crowd = results(on, prompts, [other, other, seeded, other])
    assert crowd[2] == alone[0]
    assert results(on, prompts[2:3], seeded) == alone


def test_preemption_with_speculation_keeps_the_outputs(copy_llama_dir, pair):
    on = make_llm(copy_llama_dir, NGRAM, num_kv_blocks=16, kv_cache_memory=None)
    prompts = prompts_v64(5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert results(on, prompts, params) == results(pair[1], prompts, params)
    stats = on.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def bundled_off():
    return LLM(None, kv_cache_memory=16 << 20, max_model_len=256)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_bundled_model_copies_with_speculation(bundled_off, k):
    """The bundled model asked to repeat a sentence: the same greedy text, most drafts taken."""
    on = verify_every_draft(LLM(
        None,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 2,
        },
        kv_cache_memory=16 << 20,
        max_model_len=256,
    ))
    off = bundled_off
    text = (
        "Repeat this sentence exactly: the red fox ran over the green hill to find the "
        "old oak tree.\nRepeat: the red fox"
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert results(on, [text], params) == results(off, [text], params)
    # most drafts taken: measured 1.86 / 3.25 / 4.33 tokens a verification at k = 1 / 3 / 5
    assert on.llm_engine.stats().spec_decode_mean_acceptance_length > 1 + k / 2


def test_decode_role_speculates_after_imported_kv(copy_llama_dir, pair):
    """A decode-role engine with ngram speculation continues requests whose prompt KV a
    prefill-role engine computed: the same greedy tokens as the colocated engine without it."""
    from test_disagg_engine import disaggregated

    from engine.llm import build_engine_config
    from engine.llm_engine import LLMEngine

    def make(role: str, spec: dict | None) -> LLMEngine:
        return verify_every_draft(LLMEngine(
            build_engine_config(
                copy_llama_dir,
                dtype="float32",
                role=role,
                max_model_len=256,
                num_kv_blocks=40,
                speculative_config=spec,
            )
        ))

    prefill, decode = make("prefill", NGRAM), make("decode", NGRAM)
    assert prefill.proposer is None and decode.proposer is not None
    prompts = [p["prompt_token_ids"] for p in prompts_v64(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [r[0] for r in results(pair[1], prompts_v64(4), params)]
    decoded = disaggregated(prefill, decode, prompts, params)
    assert [d[:1] + d[2:] for d in decoded] == want  # the imported first token comes twice
    assert decode.stats().spec_decode_num_accepted_tokens > 0


def test_disable_by_batch_size_stops_drafts_in_large_batches(copy_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = prompts_v64(5)
    counts = {}
    for limit in (5, 6):
        llm = make_llm(copy_llama_dir, {**NGRAM, "disable_by_batch_size": limit})
        llm.generate(prompts, params, use_tqdm=False)
        counts[limit] = llm.llm_engine.stats().spec_decode_num_drafts
    assert counts[5] == 0 < counts[6]  # five requests in flight the whole time


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_grammar_constrained_requests_speculate_and_equal_plain(tiny_llama_dir, spec):
    """Drafts of constrained requests are verified under each position's grammar mask (the
    matcher walks the drafts, then is rolled back): outputs equal plain decoding's, and follow
    the grammar."""
    import re

    from engine.structured.params import StructuredOutputsParams

    config = ({**NGRAM, "prompt_lookup_min": 1} if spec == "ngram"
              else {"model": tiny_llama_dir, "num_speculative_tokens": 3})
    on, off = make_llm(tiny_llama_dir, config), make_llm(tiny_llama_dir, None)
    pattern = r"(ab|cd)+(x|y)+"
    cases = [StructuredOutputsParams(regex=pattern),
             StructuredOutputsParams(choice=["alpha beta gamma", "alpha beta delta"])]
    for so in cases:
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
        prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 5, 6, 7], [9, 10, 11])]
        got, want = results(on, prompts, params), results(off, prompts, params)
        assert got == want
    assert all(re.fullmatch(pattern, r[1]) or r[2] == "length" for r in results(
        on, prompts, SamplingParams(temperature=0, max_tokens=40,
                                    structured_outputs=cases[0])))
    stats = on.llm_engine.stats()
    assert stats.spec_decode_num_drafts > 0
    if spec == "draft_model":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
