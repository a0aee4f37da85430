"""What the load test sends: seeded lists of requests (prompt and output length).

  random         prompts of random word tokens, length uniform in --input-len, output length
                 uniform in --output-len; no two prompts share a prefix, so no prefix cache helps
  shared-prefix  --num-prefixes system prompts of --prefix-len tokens, each request one of them
                 (in turn) followed by a random question of --input-len tokens: what prefix
                 caching is for
  sharegpt       the first human turn of each conversation in a ShareGPT-format JSON file
                 (--dataset-path) as the prompt, the length of the reply as output length
  synthetic      the same, over the conversations loadtest ships (loadtest/synthetic.py)

Every workload gives each request its prompt as text, as a chat conversation and, where it knows
them, as token ids (random and shared-prefix: exact ids; their text encodes back to them).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.tokens import Prompt, WordTokens

KINDS = ("random", "shared-prefix", "sharegpt", "synthetic")
MIN_TURN_TOKENS = 4  # ShareGPT turns shorter than this are skipped (as vLLM does)


@dataclass(frozen=True)
class RequestSpec:
    text: str  # the prompt as text (completions)
    token_ids: list[int] | None  # the same prompt as token ids, where the workload has them
    messages: list[dict[str, str]]  # the prompt as a conversation (chat)
    prompt_len: int  # tokens of the prompt (chat: of its messages' text, not the template)
    output_len: int  # max_tokens


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"
    input_len: tuple[int, int] = (128, 256)  # shared-prefix: the question after the prefix
    output_len: tuple[int, int] = (32, 64)
    num_prefixes: int = 4
    prefix_len: int = 512
    dataset_path: str = ""
    max_len: int = 2048  # sharegpt/synthetic: skip conversations longer than this (prompt+reply)
    fixed_output_len: int | None = None  # sharegpt/synthetic: instead of the reply's length

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {self.kind!r}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} needs 1 <= LOW <= HIGH, got {lo}-{hi}")
        if self.num_prefixes < 1 or self.prefix_len < 1:
            raise ValueError("num_prefixes and prefix_len must be >= 1")
        if self.kind == "sharegpt" and not self.dataset_path:
            raise ValueError("the sharegpt workload needs --dataset-path FILE.json")


def build(cfg: WorkloadConfig, tokenizer: Any, count: int, seed: int) -> list[RequestSpec]:
    """`count` requests of workload `cfg`, the same for the same seed. Raises ValueError."""
    rng = random.Random(seed)
    if cfg.kind == "random":
        return random_requests(WordTokens(tokenizer), rng, count, cfg)
    if cfg.kind == "shared-prefix":
        return shared_prefix_requests(WordTokens(tokenizer), rng, count, cfg)
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
