"""Streamed tool-call parsing of one long answer: the time to parse it step by step, and the longest step.

Run: ``python benchmarks/micro/parser_stream.py`` (``--chars``, ``--step``, ``--rounds``). The answer is one
call whose string argument is ``--chars`` long, streamed ``--step`` characters a step (about a token), as
the server's stream does: one parse per step on the event loop, so the longest step is how long one
step can hold every other request (and /health). Each parser also parses a plain answer of the same length
(content only). It runs against whichever pagedkv is imported: the whole-text API of before issue 42
(``parse(text_so_far)`` per step) or the incremental one (``feed(new_text)``); run it with each
checkout's interpreter, alternating, for a before/after.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

from pagedkv.serve.chat_output import ChatDeltas, ChatShaper
from pagedkv.serve.tool_parsers.hermes import HermesToolParser
from pagedkv.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedkv.serve.tool_parsers.mistral import MistralToolParser
from pagedkv.serve.tool_parsers.pythonic import PythonicToolParser

CALLS = {"hermes": (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"s": "%s"}}</tool_call>'),
         "llama3_json": (Llama3JsonToolParser, '{"name": "f", "parameters": {"s": "%s"}}'),
         "mistral": (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"s": "%s"}'),
         "pythonic": (PythonicToolParser, '[f(s="%s")]')}
INCREMENTAL = "tool_factory" in inspect.signature(ChatShaper).parameters


def stream(parser: type, text: str, step: int) -> tuple[float, float, int]:
    """(total seconds, longest step in seconds, calls sent) of streaming ``text`` ``step`` characters a step."""
    shaper = ChatShaper(parser, tools=["f"]) if INCREMENTAL else ChatShaper(parser())
    deltas, calls, longest = ChatDeltas(shaper), 0, 0.0
    start = time.perf_counter()
    for end in range(step, len(text) + step, step):
        final = end >= len(text)
        tick = time.perf_counter()
        delta = deltas.delta(text[end - step:end] if INCREMENTAL else text[:end], final)
        longest = max(longest, time.perf_counter() - tick)
        calls += len(delta.get("tool_calls", ()))
    return time.perf_counter() - start, longest, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=20_000)
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"API: {'incremental (feed)' if INCREMENTAL else 'whole text (parse per step)'}; "
          f"{args.chars} characters, {args.step} a step, median of {args.rounds}")
    for name, (parser, template) in CALLS.items():
        for kind, text in (("call", template % ("x" * args.chars)), ("content", "y " * (args.chars // 2))):
            runs = [stream(parser, text, args.step) for _ in range(args.rounds)]
            total = statistics.median(r[0] for r in runs)
            longest = statistics.median(r[1] for r in runs)
            print(f"{name:12s} {kind:8s} total {total * 1e3:9.1f} ms  longest step {longest * 1e3:7.2f} ms  "
                  f"calls {runs[0][2]}")


if __name__ == "__main__":
    main()
