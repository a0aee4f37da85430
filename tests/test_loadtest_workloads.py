"""The load test's workloads on the bundled tokenizer: exact prompt lengths, seeded, shared
prefixes shared, conversations growing turn by turn, ShareGPT filtering, what each request
resends; and its command line's parsing."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from loadtest import workloads
from loadtest.cli import add_arguments, configs, parse_len, parse_rates
from loadtest.synthetic import conversations
from loadtest.workloads import WorkloadConfig, build


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_random_prompts_have_exactly_their_length_as_ids_and_as_text(bundled_tokenizer):
    cfg = WorkloadConfig("random", input_len=(5, 300), output_len=(2, 9))
    specs = build(cfg, bundled_tokenizer, 40, seed=3)
    assert len(specs) == 40
    for s in specs:
        assert 5 <= s.prompt_len <= 300 and 2 <= s.output_len <= 9
        assert encode(bundled_tokenizer, s.text) == s.token_ids and len(s.token_ids) == s.prompt_len
        assert s.messages == [{"role": "user", "content": s.text}]
    assert build(cfg, bundled_tokenizer, 40, seed=3) == specs
    assert build(cfg, bundled_tokenizer, 40, seed=4) != specs
    assert len({tuple(s.token_ids[:4]) for s in specs}) == 40  # no shared prefixes


def test_shared_prefix_requests_share_their_system_prompts(bundled_tokenizer):
    cfg = WorkloadConfig("shared-prefix", input_len=(3, 8), output_len=(4, 4), num_prefixes=3,
                         prefix_len=40)
    specs = build(cfg, bundled_tokenizer, 7, seed=0)
    prefixes = [tuple(s.token_ids[:40]) for s in specs]
    assert prefixes[0] == prefixes[3] == prefixes[6] and prefixes[1] == prefixes[4]
    assert len(set(prefixes)) == 3
    for s in specs:
        system, user = s.messages
        assert system["role"] == "system" and user["role"] == "user"
        assert encode(bundled_tokenizer, system["content"]) == s.token_ids[:40]
        assert encode(bundled_tokenizer, user["content"]) == s.token_ids[40:]
        assert encode(bundled_tokenizer, s.text) == s.token_ids
        assert 43 <= s.prompt_len == len(s.token_ids) <= 48


def test_multi_turn_conversations_grow_and_interleave(bundled_tokenizer):
    """3 conversations of 2 turns after a 20-token system prompt: request i is conversation
    i % 3's next turn; turn 2 resends turn 1 and a reply as long as turn 1's output."""
    cfg = WorkloadConfig("multi-turn", input_len=(6, 9), output_len=(3, 5), prefix_len=20,
                         num_conversations=3, num_turns=2)
    specs = build(cfg, bundled_tokenizer, 8, seed=1)
    assert [len(s.messages) for s in specs] == [2, 2, 2, 4, 4, 4, 2, 2]
    for first, second in zip(specs[:3], specs[3:6]):
        assert second.token_ids[:first.prompt_len] == first.token_ids
        assert second.messages[:2] == first.messages
        reply = second.messages[2]
        assert reply["role"] == "assistant"
        assert len(encode(bundled_tokenizer, reply["content"])) == first.output_len
        assert second.reused_len == first.prompt_len  # the history, sent by turn 1
    assert [s.reused_len for s in specs[:3]] == [0, 20, 20]  # the shared system prompt
    assert specs[6].token_ids[:20] == specs[0].token_ids[:20] and specs[6].reused_len == 20
    for s in specs:
        assert encode(bundled_tokenizer, s.text) == s.token_ids
        assert s.prompt_len == len(s.token_ids)
    assert build(cfg, bundled_tokenizer, 8, seed=1) == specs


def test_reuse_is_the_longest_prefix_an_earlier_request_sent():
    def spec(ids):
        return workloads.RequestSpec("", ids, [], len(ids or "?"), 1)

    got = workloads.with_reuse([spec([1, 2, 3]), spec([1, 2, 4, 5]), spec([1, 2, 4, 5, 6]),
                                spec([9]), spec([1, 2, 3]), spec(None)])
    assert [s.reused_len for s in got] == [0, 2, 4, 0, 3, 0]


def _conversation(human: str, gpt: str, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {"conversations": [{"from": first, "value": human}, {"from": second, "value": gpt}]}


def test_sharegpt_takes_first_turns_and_skips_short_long_and_odd_ones(bundled_tokenizer,
                                                                       tmp_path):
    good = _conversation("Tell me about the history of the Roman Empire please.",
                         "The Roman Empire lasted for many centuries and changed the world.")
    data = [
        good,
        _conversation("Hi", "Hello there, how can I help you today?"),  # prompt < 4 tokens
        _conversation("Tell me a long story about dragons.", "word " * 500),  # too long
        _conversation("Tell me about the history of Rome.", "It is long.", first="gpt"),
        {"conversations": [{"from": "human", "value": "Only one turn here, no reply."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    cfg = WorkloadConfig("sharegpt", dataset_path=str(path), max_len=200)
    [s] = build(cfg, bundled_tokenizer, 1, seed=0)
    human, gpt = (t["value"] for t in good["conversations"])
    assert s.text == human and s.token_ids is None
    assert s.messages == [{"role": "user", "content": human}]
    assert s.prompt_len == len(encode(bundled_tokenizer, human))
    assert s.output_len == len(encode(bundled_tokenizer, gpt))
    with pytest.raises(ValueError, match="1 usable conversations, 2 needed"):
        build(cfg, bundled_tokenizer, 2, seed=0)
    fixed = WorkloadConfig("sharegpt", dataset_path=str(path), fixed_output_len=6)
    assert build(fixed, bundled_tokenizer, 1, seed=0)[0].output_len == 6


def test_the_synthetic_set_is_fixed_and_usable(bundled_tokenizer):
    assert conversations() == conversations()
    assert len(conversations()) == 400
    specs = build(WorkloadConfig("synthetic", max_len=512), bundled_tokenizer, 100, seed=1)
    assert specs == build(WorkloadConfig("synthetic", max_len=512), bundled_tokenizer, 100, 1)
    assert all(s.prompt_len >= 4 and s.prompt_len + s.output_len <= 512 for s in specs)
    assert len({s.output_len for s in specs}) > 20  # replies of many lengths


def test_workload_config_is_checked():
    for bad in (dict(kind="zipf"), dict(input_len=(5, 4)), dict(output_len=(0, 3)),
                dict(num_prefixes=0), dict(kind="sharegpt")):
        with pytest.raises(ValueError):
            WorkloadConfig(**bad)
    assert workloads.KINDS == ("random", "shared-prefix", "multi-turn", "sharegpt", "synthetic")
    with pytest.raises(ValueError, match="num_turns must be >= 1"):
        WorkloadConfig("multi-turn", num_turns=0)


def test_command_line_parsing():
    assert parse_len("128") == (128, 128) and parse_len("16-256") == (16, 256)
    assert parse_rates("0.5,1,inf") == (0.5, 1.0, math.inf)
    for bad in ("0", "9-3", "a-b", "1-"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_len(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rates("1,0")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--request-rate", "1,2", "--num-prompts", "5", "--num-warmups",
                              "2", "--slo-ttft-ms", "500", "--endpoint", "chat",
                              "--extra-body", '{"top_k": 1}'])
    work, client, run = configs(args)
    assert work.kind == "random" and client.endpoint == "chat"
    assert client.extra_body == {"top_k": 1}
    assert run.total_requests == 12 and run.slo.ttft_s == 0.5 and run.slo.tpot_s is None
