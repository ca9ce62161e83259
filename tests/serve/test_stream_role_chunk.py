"""A streamed chat's role chunk goes out with the first token, not at admission (clients time the first chunk).

The engine's steps are slowed until one has produced a token, so prefill takes measurable time; the
role chunk must not reach the client before that step returned.
"""

from __future__ import annotations

import json
import time

import httpx
from serve_helpers import running_server, tiny_chat_engine

from pagedkv.serve.testing import byte_level_tokenizer

PREFILL_S = 0.6  # each step sleeps this long until the first token exists


def slowed_until_first_token(engine) -> list[float]:
    """Make ``engine.step`` slow until it produces a token; the returned list gets that moment."""
    step, produced = engine.step, []

    def slow_step(*args, **kwargs):
        if not produced:
            time.sleep(PREFILL_S)
        outputs = step(*args, **kwargs)
        if not produced and any(c.token_ids for out in outputs for c in out.outputs):
            produced.append(time.monotonic())
        return outputs

    engine.step = slow_step
    return produced


def test_the_role_chunk_waits_for_the_first_token():
    engine = tiny_chat_engine(byte_level_tokenizer())
    produced = slowed_until_first_token(engine)
    body = {"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "stream": True, "n": 2}
    with running_server(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        arrivals = []
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic(), line[6:]))
    assert arrivals[-1][1] == "[DONE]"
    chunks = [(at, json.loads(data)) for at, data in arrivals[:-1]]
    roles = [(at, c) for at, c in chunks if c["choices"][0]["delta"].get("role")]
    # the order and content are as before: each choice's role chunk first, then the tokens
    assert [c["choices"][0]["index"] for _, c in chunks[:2]] == [0, 1] and roles == chunks[:2]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for _, c in roles)
    assert produced and all(at >= produced[0] for at, _ in roles)
