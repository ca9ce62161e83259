"""instructor's TOOLS and JSON_SCHEMA modes, unmodified, against a live ``engine serve``: the issue's case 3 (a
Pydantic model's schema leaves additionalProperties unset; unlisted keys must not be generated, or the answer runs
to max_tokens and fails to parse). instructor runs in .venv-clients (make setup builds it from
tests/clients/instructor-requirements.txt; PAGEDKV_CLIENTS_VENV names another), in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from client_server import COMMA_BIAS, TRIP_KEYS, tool_server
from repo_paths import ROOT, TESTS
from serve_helpers import MODEL

VENV = Path(os.environ.get("PAGEDKV_CLIENTS_VENV", ROOT / ".venv-clients"))
SKIP = 77  # instructor_script.py's exit code when instructor is missing


@pytest.fixture(scope="module")
def url():
    with tool_server() as base:
        yield base


def test_tools_and_json_schema_modes_validate_the_model(url):
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"instructor's venv {VENV} is missing (make setup creates it)")
    done = subprocess.run([str(python), str(TESTS / "clients" / "instructor_script.py"), url, MODEL,
                           json.dumps(COMMA_BIAS)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode == SKIP:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    tools, schema = results["TOOLS"], results["JSON_SCHEMA"]
    assert set(tools["trip"]) == set(schema["trip"]) == TRIP_KEYS
    # TOOLS forces the model's tool (named tool_choice); JSON_SCHEMA answers in the content (response_format)
    assert tools["tool_calls"] == ["Trip"] and tools["finish_reason"] in ("tool_calls", "stop")
    assert schema["tool_calls"] == [] and json.loads(schema["content"]) == schema["trip"]
    assert schema["finish_reason"] == "stop"
