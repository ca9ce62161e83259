"""Safe defaults and batch files that never lose results (issue 25), through the real ``engine`` command.

Flags are checked before the model loads: each case names a model that does not exist, so
an error about the flag (not the model) proves the check came first.
"""

from __future__ import annotations

import json

import pytest
from test_reliability_cli import RUN, assert_one_line_error, base_model, engine  # noqa: F401

NO_MODEL = ("--model", "/nonexistent/model-dir")


@pytest.mark.parametrize(("flags", "env", "needles"), [
    (("--port", "99999"), {}, ("--port", "99999")),
    (("--port", "-1"), {}, ("--port",)),
    (("--max-waiting", "-1"), {}, ("--max-waiting",)),
    (("--max-waiting", "0"), {}, ("--max-waiting",)),
    (("--limit-concurrency", "0"), {}, ("--limit-concurrency",)),
    (("--max-request-bytes", "12"), {}, ("--max-request-bytes",)),
    (("--max-request-bytes", "lots"), {}, ("lots",)),
    (("--shutdown-timeout", "-3"), {}, ("--shutdown-timeout",)),
    (("--header-timeout", "0"), {}, ("--header-timeout",)),
    (("--body-timeout", "nan"), {}, ("--body-timeout",)),
    (("--api-key", ""), {}, ("--api-key", "empty")),
    (("--api-key", "  "), {}, ("--api-key", "empty")),
    ((), {"PAGEDKV_API_KEY": ""}, ("PAGEDKV_API_KEY", "empty")),
    (("--host", "0.0.0.0"), {}, ("--host 0.0.0.0", "--allow-insecure-host")),
    (("--host", "::"), {}, ("--allow-insecure-host",)),
])
def test_a_bad_or_unsafe_serve_flag_is_one_line_before_the_model_loads(flags, env, needles):
    proc = engine("serve", *NO_MODEL, *flags, timeout=120, env=env)
    assert_one_line_error(proc, *needles)


@pytest.mark.parametrize("flags", [("--host", "0.0.0.0", "--allow-insecure-host"),
                                   ("--host", "0.0.0.0", "--api-key", "k"), ("--host", "localhost"),
                                   ("--host", "::1")])
def test_an_exposed_host_with_a_key_or_an_explicit_opt_in_gets_as_far_as_the_model(flags):
    proc = engine("serve", *NO_MODEL, *flags, timeout=120)
    err = assert_one_line_error(proc)
    assert "/nonexistent/model-dir" in err  # the flags passed: the model was the next thing checked


# --- batch files -----------------------------------------------------------------------------------------------------


def _line(custom_id: str, prompt: str, **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 2, **body}}).encode()


def test_undecodable_lines_get_their_own_error_and_the_rest_run(base_model, tmp_path):  # noqa: F811
    source = tmp_path / "in.jsonl"
    lines = [_line("a", "w1 w2"), b'{"custom_id": "bad-utf8", "url": "/v1/completions", "body": {"prompt": "\xff"}}',
             _line("b", "w3"), _line("surrogate", "w1 \\ud800").replace(b"\\\\ud800", b"\\ud800"),
             _line("coerced", "w4", max_tokens="2"), _line("c", "w5")]
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    proc = engine(*RUN, "--model", str(base_model), "--input", str(source), "--output", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in results}
    assert len(results) == 6
    for ok in ("a", "b", "c"):
        assert by_id[ok]["response"]["status_code"] == 200, by_id[ok]
    errors = [r for r in results if r["error"] is not None]
    assert len(errors) == 3
    messages = " | ".join(r["error"]["message"] for r in errors)
    assert "line 2" in messages and "UTF-8" in messages and "surrogate" in messages and "max_tokens" in messages


def test_a_run_that_fails_before_its_first_result_leaves_the_output_untouched(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(_line("a", "w1") + b"\n")
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n" * 27)
    proc = engine(*RUN, "--model", str(tmp_path / "no-such-model"), "--input", str(source), "--output", str(out))
    assert_one_line_error(proc, "no-such-model")
    assert out.read_text() == "precious\n" * 27


@pytest.mark.parametrize("where", ["directory", "missing-folder", "same-as-input"])
def test_a_bad_output_path_is_one_line_before_the_model_loads(tmp_path, where):
    source = tmp_path / "in.jsonl"
    source.write_bytes(_line("a", "w1") + b"\n")
    out = {"directory": tmp_path, "missing-folder": tmp_path / "nope" / "out.jsonl", "same-as-input": source}[where]
    proc = engine(*RUN, "--model", str(tmp_path / "no-such-model"), "--input", str(source), "--output", str(out))
    err = assert_one_line_error(proc, "--output")
    assert "no-such-model" not in err
    assert source.read_bytes() == _line("a", "w1") + b"\n"
