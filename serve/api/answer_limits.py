"""Limits on the work one request's answer can ask for, beyond ``--max-logprobs`` (issue 42, row 9).

``prompt_logprobs`` costs a log-softmax over the vocabulary and a top-k for every prompt token,
and an answer entry per token: 32 prompts of 1,900 tokens with ``prompt_logprobs`` 20 made a
115 MB answer that held the server for seconds. A request's prompt logprobs therefore cover at
most ``--max-prompt-logprobs-tokens`` prompt tokens, all its prompts together (default: one
context's worth); within a step their work is bounded by the step's token budget, since they are
computed with the prefill chunk that holds the tokens.
"""

from __future__ import annotations

from typing import Any

from pagedkv.serve.api.errors import InvalidField


def check_prompt_logprobs(body: Any, params: Any, prompts: list[list[int]], limit: int) -> None:
    """400 naming ``prompt_logprobs`` (or ``echo``, whose logprobs are the prompt's) when the request asks
    for prompt logprobs over more than ``limit`` prompt tokens."""
    if params.prompt_logprobs is None:
        return
    tokens = sum(map(len, prompts))
    if tokens > limit:
        field = "prompt_logprobs" if getattr(body, "prompt_logprobs", None) is not None else "echo"
        raise InvalidField(field, f"{field} asks for the logprobs of {tokens:,} prompt tokens ({len(prompts)} "
                           f"prompt(s)); this server computes them for at most {limit:,} tokens per request "
                           "(--max-prompt-logprobs-tokens)")
