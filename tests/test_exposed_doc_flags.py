"""docs/exposed.md names every hardening flag of ``engine serve`` (issue 42: "docs/exposed.md says what a server
exposed to the internet should set"): a limit, timeout or trust switch added to the CLI without a word there fails.

The hardening flags are recognised by name: every ``--max-*``, ``--*-timeout``, ``--grammar-*``, ``--trust-*``,
``--limit-*`` and ``--priority-*`` option, plus the access switches listed in ACCESS.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pagedkv.cli.serve import add_arguments

DOC = Path(__file__).resolve().parents[1] / "docs" / "exposed.md"
ACCESS = {"--host", "--api-key", "--allow-insecure-host", "--enable-docs", "--max-inflight-body-bytes",
          "--scheduling-policy"}
PATTERN = re.compile(r"^--(max-.*|.*-timeout|grammar-.*|trust-.*|limit-.*|priority-.*)$")


def hardening_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}
    return {flag for flag in options if PATTERN.match(flag)} | (ACCESS & options)


def test_the_pattern_finds_the_known_hardening_flags() -> None:
    flags = hardening_flags()
    for known in ("--max-request-bytes", "--header-timeout", "--trust-request-chat-template", "--max-grammar-bytes",
                  "--grammar-compile-timeout", "--priority-aging-steps", "--max-inflight-body-bytes", "--api-key"):
        assert known in flags


def test_every_hardening_flag_is_named_in_docs_exposed() -> None:
    text = DOC.read_text()
    missing = sorted(flag for flag in hardening_flags() if not re.search(re.escape(flag) + r"(?![\w-])", text))
    assert not missing, f"docs/exposed.md does not name: {', '.join(missing)}"
