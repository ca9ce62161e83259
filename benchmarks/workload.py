"""The seeded end-to-end workload: chat prompts with per-request output lengths.

Issue 2's workload: 32 chat prompts, output lengths drawn uniformly from 8..128
tokens with a fixed seed, greedy decoding, EOS ignored (every request produces
exactly its own number of tokens, so all systems do the same useful work).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pagedkv.cli.demo import DEMO_PROMPTS

# 40 short user messages of mixed kind and length; a workload of n takes a seeded sample of them.
CHAT_TEXTS = [
    *DEMO_PROMPTS,  # the `engine run` demo prompts first, then 32 more
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Write a limerick about a cat who loves to code.",
    "What are the main differences between Python lists and tuples?",
    "Suggest a name for a bakery that sells only bread made with sourdough.",
    "How do I boil an egg so that the yolk stays soft?",
    "Explain what a hash table is to a ten year old.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "What does HTTP status code 404 mean?",
    "Write a short motivational message for someone starting a new job.",
    "Describe the water cycle.",
    "Which planet in our solar system is the largest, and how large is it?",
    "Tell me a fun fact about octopuses.",
    "How can I improve my sleep?",
    "Write a polite email declining a meeting invitation.",
    "What is the difference between weather and climate?",
    "Explain recursion with a simple example.",
    "Recommend a good book for learning about history, and say why.",
    "What are the benefits of regular exercise?",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.",
    "Write the opening line of a mystery novel set in a lighthouse.",
    "What is photosynthesis?",
    "Give me a simple recipe for tomato soup.",
    "How does a bicycle stay upright when it moves?",
    "Explain the rules of tic-tac-toe.",
    "What is the Pythagorean theorem?",
    "Write a two-line poem about the ocean at night.",
    "Why do we have leap years?",
    "Name five animals that live in the Arctic.",
    "What should I pack for a weekend hiking trip?",
    "Explain what an operating system does.",
    "How do vaccines work?",
]

DEFAULT_SEED = 1234
MIN_OUTPUT, MAX_OUTPUT = 8, 128


@dataclass(frozen=True)
class Workload:
    texts: list[str]
    prompt_ids: list[list[int]]  # chat template applied
    max_tokens: list[int]  # output length of each request (EOS ignored)
    seed: int

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def take(self, n: int) -> Workload:
        """The first ``n`` requests (for the concurrency sweep)."""
        return Workload(self.texts[:n], self.prompt_ids[:n], self.max_tokens[:n], self.seed)


def build_workload(tokenizer: Any, num_requests: int = 32, seed: int = DEFAULT_SEED) -> Workload:
    """``num_requests`` chat prompts (cycled from :data:`CHAT_TEXTS` in a seeded order)
    with output lengths drawn uniformly from ``MIN_OUTPUT..MAX_OUTPUT``."""
    from pagedkv.core.llm import apply_chat_template

    rng = random.Random(seed)
    order = list(range(len(CHAT_TEXTS)))
    rng.shuffle(order)
    texts = [CHAT_TEXTS[order[i % len(order)]] for i in range(num_requests)]
    max_tokens = [rng.randint(MIN_OUTPUT, MAX_OUTPUT) for _ in range(num_requests)]
    prompt_ids = [apply_chat_template(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return Workload(texts, prompt_ids, max_tokens, seed)
