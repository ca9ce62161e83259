"""The installed `engine` command run as a user runs it, in a subprocess, and the one-line error it must give."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT

_SCRIPT = Path(sys.executable).parent / "engine"  # the installed entry point, wherever the CLI module lives
ENGINE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "pagedkv.cli.main"]
QUIET = {"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # no weight-loading bar on stderr


def engine(*args: str | bytes, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [*ENGINE, *args]
    full_env = {**os.environ, **QUIET, **(env or {})}
    return subprocess.run(cmd, capture_output=True, timeout=timeout, cwd=ROOT, env=full_env)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("engine: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
