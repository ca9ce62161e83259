"""The built-in demo workload of `engine run`: a few short chat prompts."""

from __future__ import annotations

DEMO_PROMPTS = [
    "안녕하세요 반갑습니다",
    "What is the capital of France?",
    "Write a haiku about memory paging.",
    "Explain in one sentence why a KV cache speeds up text generation.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Give me a short tip for writing clear code.",
    "Translate 'good morning' into Spanish.",
]
