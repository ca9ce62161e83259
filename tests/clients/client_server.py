"""The server the framework tests point at: the tiny random Llama over the byte tokenizer (any text round-trips and
a grammar constrains it byte by byte), with the hermes tool parser and auto tool choice, as the issue's clients were
tried against. A random model writes no sensible text, so each test asks for a forced tool or a schema: the grammar,
not the model, makes the structure valid, and the test checks the protocol around it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pydantic import BaseModel, Field
from serve_helpers import running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama


class City(BaseModel):
    """A city and its rank (bounded, so a constrained answer ends well inside max_tokens)."""

    name: str = Field(max_length=8)
    rank: int = Field(ge=1, le=99)


class Stop(BaseModel):
    day: int = Field(ge=1, le=9)


class Trip(BaseModel):
    """Four objects, none setting additionalProperties: at each closing brace a grammar that allowed unlisted keys
    lets the tiny model start one (the issue's case 3), which then runs to max_tokens; closed, it ends in ~40 bytes."""

    first: Stop
    second: Stop
    third: Stop


TRIP_KEYS = {"first", "second", "third"}
# logit_bias toward "," (byte 44): greedy, a grammar that allowed another key at a closing brace takes one; a closed
# schema allows "," only between its listed keys, where it is due anyway (Trip has no strings)
COMMA_BIAS = {"44": 10}


@contextlib.contextmanager
def tool_server() -> Iterator[str]:
    """Yield the base URL of a live server (no /v1) until the block ends."""
    engine = Engine(EngineConfig(device="cpu", num_blocks=512, block_size=8),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1, max_position_embeddings=2048),
                    tokenizer=byte_tokenizer())
    with running_server(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as (url, _):
        yield url
