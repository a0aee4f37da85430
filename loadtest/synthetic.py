"""A small synthetic conversation set in ShareGPT format, for load tests with no dataset at hand.

    python -m loadtest.synthetic out.json      # write it, to look at or to pass as --dataset-path

Made offline, deterministically, from templates below: questions of several shapes about a few
dozen topics, answers of one to a dozen sentences in one to three paragraphs (with SmolLM2's
tokenizer: prompts of 4-22 tokens, replies of 13-610, 214 on average). It ships as code rather
than as a file: the same conversations on every machine, nothing to download. Its text is
filler with the statistics of chat, not content.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

SIZE = 400
SEED = 20240501

TOPICS = [
    "the water cycle", "photosynthesis", "the French Revolution", "black holes", "vaccines",
    "the stock market", "machine learning", "the Roman Empire", "plate tectonics", "jazz music",
    "climate change", "the human heart", "compound interest", "the printing press", "volcanoes",
    "electric cars", "the immune system", "ancient Egypt", "quantum computing", "honey bees",
    "the Renaissance", "nuclear fusion", "sleep", "the internet", "coral reefs", "inflation",
    "the Moon landing", "chess openings", "bread baking", "the Silk Road", "earthquakes",
    "solar panels", "the theory of evolution", "the Great Wall of China", "coffee",
]
QUESTIONS = [
    "What is {t}?",
    "Can you explain {t} to a ten year old?",
    "Give me a short summary of {t}.",
    "Why does {t} matter today?",
    "What are three surprising facts about {t}?",
    "I am writing an essay on {t}. What should I cover, and in what order?",
    "Compare {t} with {u} and say which one you find more interesting.",
    "Write a short poem about {t}.",
    "What are the most common misconceptions about {t}, and where do they come from?",
    "My friend says {t} is overrated. How would you answer?",
]
SENTENCES = [
    "In short, {t} is best understood as a process that unfolds over time.",
    "Many people first meet {t} at school, but rarely see how it connects to daily life.",
    "Historians and scientists still debate several details of {t}.",
    "A useful way to think about {t} is to start from a simple example and build up.",
    "The key idea is that small causes can add up to large effects.",
    "It also helps to compare {t} with {u}, which follows a similar pattern.",
    "Numbers make this concrete: measurements taken over decades show a clear trend.",
    "There are exceptions, and they are often the most instructive cases.",
    "One common mistake is to treat {t} as a single event rather than a system.",
    "If you want to go further, a good next step is to read a recent overview.",
    "Finally, remember that our understanding of {t} keeps changing as evidence comes in.",
    "Experts usually split the subject into a few parts and study each one on its own.",
]


def conversations(size: int = SIZE, seed: int = SEED) -> list[dict[str, Any]]:
    """`size` two-turn ShareGPT conversations ({"id", "conversations": [human, gpt]})."""
    rng = random.Random(seed)
    out = []
    for i in range(size):
        topic, other = rng.sample(TOPICS, 2)
        question = rng.choice(QUESTIONS).format(t=topic, u=other)
        sentences = [rng.choice(SENTENCES) for _ in range(rng.randint(1, 12))]
        paragraphs = rng.randint(1, 3)
        answer = " ".join(s.format(t=topic, u=other) for s in sentences)
        answer = "\n\n".join([answer] * paragraphs)
        out.append({"id": f"synthetic-{i}", "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m loadtest.synthetic OUT.json", file=sys.stderr)
        return 2
    with open(args[0], "w") as f:
        json.dump(conversations(), f, indent=1)
    print(f"wrote {SIZE} conversations to {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
