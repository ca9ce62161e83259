"""The process that renders clients' chat templates (``--trust-request-chat-template``): ``python -m`` this module.

A client's template is code. In the server's process a 90-byte nested loop held the tokenizer
thread for ~40 minutes and ``{{ 'x' * 300000000 }}`` added a gigabyte to its RSS; a thread cannot
be stopped, a process can. So the server (``serve/http/template_sandbox.py``) sends each render
here and kills this process when it runs over its time limit. Here, each render stops as soon as
its text passes the length the server gives (nothing longer could fit the context), and the
address space is capped (``RLIMIT_AS``, argv[1] bytes), so a single huge expression fails with
MemoryError here instead of growing anything in the server.

Frames both ways: 8-byte big-endian length, then UTF-8 JSON. First frame out: ``{"ready": true}``.
A job in: ``{template, messages, tools, documents, add_generation_prompt, continue_final_message,
variables, max_chars}``; out: ``{"text": ...}`` or ``{"error": ..., "kind": "template" | "too_long" |
"memory"}``. After a MemoryError the process answers, then exits (the server starts a fresh one).
SIGINT is ignored (a Ctrl-C in the terminal is the server's to handle) and, on Linux, the process
dies with the server (``PR_SET_PDEATHSIG``). Only jinja2 and ``chat_render`` are imported.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any, BinaryIO

HEADER_BYTES = 8


def _limit_self(address_space: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if address_space > 0:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        except (ImportError, ValueError, OSError):  # no such limit here (not Linux): the time limit still holds
            pass
    if sys.platform.startswith("linux"):
        import ctypes

        try:  # PR_SET_PDEATHSIG = 1: SIGKILL when the server goes, even mid-render
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def read_frame(stream: BinaryIO) -> Any:
    """The next JSON frame, or None at the end of the stream."""
    header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        return None
    return json.loads(stream.read(int.from_bytes(header, "big")))


def write_frame(stream: BinaryIO, value: Any) -> None:
    data = json.dumps(value).encode("ascii")  # ASCII escapes carry lone surrogates (JSON bodies can hold them)
    stream.write(len(data).to_bytes(HEADER_BYTES, "big") + data)
    stream.flush()


def render(job: dict[str, Any]) -> dict[str, Any]:
    """One job's answer: the text, or the error a client should read."""
    from pagedkv.core.model.chat_render import RenderTooLong, render_json_chat

    try:
        text = render_json_chat(job["template"], job["messages"], job["tools"], job["documents"],
                                job["add_generation_prompt"], job["continue_final_message"], job["variables"],
                                job["max_chars"])
    except RenderTooLong as exc:
        return {"error": str(exc), "kind": "too_long"}
    except MemoryError:
        return {"error": "out of memory", "kind": "memory"}
    except RecursionError:
        return {"error": "RecursionError: too deeply nested", "kind": "template"}
    except Exception as exc:  # noqa: BLE001 - whatever the client's template raises is the client's error
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "kind": "template"}
    return {"text": text}


def main(argv: list[str]) -> int:
    _limit_self(int(argv[1]) if len(argv) > 1 else 0)
    import jinja2.sandbox  # noqa: F401 - imported before "ready", so no render pays for it

    import pagedkv.core.model.chat_render  # noqa: F401

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_frame(stdout, {"ready": True})
    while (job := read_frame(stdin)) is not None:
        answer = render(job)
        job = None  # the job's data is not kept while the next one is read
        write_frame(stdout, answer)
        if answer.get("kind") == "memory":
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
