"""What the load test sends: seeded lists of requests (prompt and output length).

  random         prompts of random word tokens, length uniform in --input-len, output length
                 uniform in --output-len; no two prompts share a prefix, so no prefix cache helps
  shared-prefix  --num-prefixes system prompts (or documents) of --prefix-len tokens, each
                 request one of them (in turn) followed by a random question of --input-len
                 tokens: what prefix caching is for
  multi-turn     --num-conversations conversations interleaved (request i belongs to
                 conversation i mod N), each --num-turns turns long, all after one shared system
                 prompt of --prefix-len tokens: turn k resends the whole history (every earlier
                 user message of --input-len tokens and a stand-in assistant reply as long as
                 that turn's output) and a new user message. So turn k + 1 is sent N requests
                 after turn k: at R requests/s, N / R seconds later; a finished conversation's
                 slot starts a new one. (The replies in the history are the workload's, not the
                 server's: what a server cached of its own reply is not reused.)
  sharegpt       the first human turn of each conversation in a ShareGPT-format JSON file
                 (--dataset-path) as the prompt, the length of the reply as output length
  synthetic      the same, over the conversations loadtest ships (loadtest/synthetic.py)

Every workload gives each request its prompt as text, as a chat conversation and, where it knows
them, as token ids (random, shared-prefix and multi-turn: exact ids; their text encodes back to
them), and how many of its leading tokens an earlier request of the workload sent already
(`reused_len`: what a prefix cache could hit, at most).
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.tokens import Prompt, WordTokens

KINDS = ("random", "shared-prefix", "multi-turn", "sharegpt", "synthetic")
MIN_TURN_TOKENS = 4  # ShareGPT turns shorter than this are skipped (as vLLM does)


@dataclass(frozen=True)
class RequestSpec:
    text: str  # the prompt as text (completions)
    token_ids: list[int] | None  # the same prompt as token ids, where the workload has them
    messages: list[dict[str, str]]  # the prompt as a conversation (chat)
    prompt_len: int  # tokens of the prompt (chat: of its messages' text, not the template)
    output_len: int  # max_tokens
    reused_len: int = 0  # leading token ids an earlier request sent too (0 without token ids)


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"
    input_len: tuple[int, int] = (128, 256)  # shared-prefix: the question after the prefix
    output_len: tuple[int, int] = (32, 64)
    num_prefixes: int = 4
    prefix_len: int = 512  # multi-turn: the shared system prompt
    dataset_path: str = ""
    max_len: int = 2048  # sharegpt/synthetic: skip conversations longer than this (prompt+reply)
    fixed_output_len: int | None = None  # sharegpt/synthetic: instead of the reply's length
    num_conversations: int = 8  # multi-turn: interleaved
    num_turns: int = 4  # multi-turn: per conversation

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {self.kind!r}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} needs 1 <= LOW <= HIGH, got {lo}-{hi}")
        for name in ("num_prefixes", "prefix_len", "num_conversations", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "sharegpt" and not self.dataset_path:
            raise ValueError("the sharegpt workload needs --dataset-path FILE.json")


def build(cfg: WorkloadConfig, tokenizer: Any, count: int, seed: int) -> list[RequestSpec]:
    """`count` requests of workload `cfg`, the same for the same seed. Raises ValueError."""
    rng = random.Random(seed)
    if cfg.kind == "random":
        return with_reuse(random_requests(WordTokens(tokenizer), rng, count, cfg))
    if cfg.kind == "shared-prefix":
        return with_reuse(shared_prefix_requests(WordTokens(tokenizer), rng, count, cfg))
    if cfg.kind == "multi-turn":
        return with_reuse(multi_turn_requests(WordTokens(tokenizer), rng, count, cfg))
    if cfg.kind == "sharegpt":
        conversations = json.loads(Path(cfg.dataset_path).read_text())
    else:
        from loadtest.synthetic import conversations as synthetic

        conversations = synthetic()
    return sharegpt_requests(conversations, tokenizer, rng, count, cfg)


def _spec(prompt: Prompt, output_len: int) -> RequestSpec:
    messages = [{"role": "user", "content": prompt.text}]
    return RequestSpec(prompt.text, prompt.token_ids, messages, len(prompt.token_ids), output_len)


def random_requests(
    words: WordTokens, rng: random.Random, count: int, cfg: WorkloadConfig
) -> list[RequestSpec]:
    return [_spec(words.sample(rng, rng.randint(*cfg.input_len)), rng.randint(*cfg.output_len))
            for _ in range(count)]


def shared_prefix_requests(
    words: WordTokens, rng: random.Random, count: int, cfg: WorkloadConfig
) -> list[RequestSpec]:
    """Request i: prefix i % num_prefixes, then its own question. As text (completions) the
    two are decoded together; as chat the prefix is the system message."""
    prefixes = [words.sample(rng, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    specs = []
    for i in range(count):
        prefix = prefixes[i % len(prefixes)]
        question = words.sample(rng, rng.randint(*cfg.input_len))
        ids = prefix.token_ids + question.token_ids
        messages = [{"role": "system", "content": prefix.text},
                    {"role": "user", "content": question.text}]
        text = words.tokenizer.decode(ids)
        specs.append(RequestSpec(text, ids, messages, len(ids), rng.randint(*cfg.output_len)))
    return specs


def multi_turn_requests(
    words: WordTokens, rng: random.Random, count: int, cfg: WorkloadConfig
) -> list[RequestSpec]:
    """Request i: the next turn of the conversation in slot i % num_conversations (see the
    module's note). As text the history is decoded whole; as chat it is the messages."""
    system = words.sample(rng, cfg.prefix_len)
    slots: list[list[tuple[str, list[int], str]]] = [[] for _ in range(cfg.num_conversations)]
    specs = []
    for i in range(count):
        history = slots[i % cfg.num_conversations]
        if len(history) == 2 * cfg.num_turns:  # its last turn was sent: a new conversation
            history.clear()
        user = words.sample(rng, rng.randint(*cfg.input_len))
        history.append(("user", user.token_ids, user.text))
        ids = system.token_ids + [t for _, turn_ids, _ in history for t in turn_ids]
        messages = [{"role": "system", "content": system.text},
                    *({"role": role, "content": text} for role, _, text in history)]
        output_len = rng.randint(*cfg.output_len)
        specs.append(RequestSpec(words.tokenizer.decode(ids), ids, messages, len(ids),
                                 output_len))
        reply = words.sample(rng, output_len)  # the stand-in reply the next turn resends
        history.append(("assistant", reply.token_ids, reply.text))
    return specs


def with_reuse(specs: list[RequestSpec]) -> list[RequestSpec]:
    """`specs` with `reused_len` set: the longest prefix of each one's token ids that some
    earlier spec's token ids start with (walked down a trie of every prompt sent before)."""
    root: dict[int, dict] = {}
    out = []
    for spec in specs:
        ids = spec.token_ids or []
        node, reused = root, 0
        while reused < len(ids) and ids[reused] in node:
            node = node[ids[reused]]
            reused += 1
        for token in ids[reused:]:
            node = node.setdefault(token, {})
        out.append(dataclasses.replace(spec, reused_len=reused))
    return out


def sharegpt_requests(
    conversations: list[dict[str, Any]], tokenizer: Any, rng: random.Random, count: int,
    cfg: WorkloadConfig,
) -> list[RequestSpec]:
    """The first (human, gpt) turns of shuffled conversations; too short or too long skipped."""
    pairs = [_first_turns(c) for c in conversations]
    pairs = [p for p in pairs if p is not None]
    rng.shuffle(pairs)
    specs = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = cfg.fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if min(prompt_len, output_len) < MIN_TURN_TOKENS or prompt_len + output_len > cfg.max_len:
            continue
        messages = [{"role": "user", "content": prompt}]
        specs.append(RequestSpec(prompt, None, messages, prompt_len, output_len))
        if len(specs) == count:
            return specs
    raise ValueError(f"the dataset has {len(specs)} usable conversations, {count} needed "
                     f"(fewer prompts, rates or warm-ups; or a larger --max-len)")


def _first_turns(conversation: dict[str, Any]) -> tuple[str, str] | None:
    turns = conversation.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
        return None
    return turns[0]["value"], turns[1]["value"]
