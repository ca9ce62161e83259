"""Fuzz the workload parsers: any malformed file gives a WorkloadError naming where, never a crash."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.sim.workload import WorkloadError, load_jsonl, load_workload

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(["arrival", "prompt_len", "prompt_token_ids", "output_len", "id", "n", "bogus"])
request_objects = st.dictionaries(field_names, json_values, max_size=5)
lines = st.one_of(request_objects.map(json.dumps), st.text(max_size=40), json_values.map(json.dumps))


def _write(text: str) -> Path:
    handle = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8")
    with handle:
        handle.write(text)
    return Path(handle.name)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(lines, max_size=6))
def test_malformed_jsonl_gives_a_workload_error_or_a_workload(file_lines):
    path = _write("\n".join(file_lines))
    try:
        for loader in (load_jsonl, load_workload):
            try:
                workload = loader(path)
            except WorkloadError as exc:
                assert str(path) in str(exc)  # the message says which file (and line, where there is one)
            else:
                assert workload.requests
    finally:
        path.unlink()


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.lists(json_values.map(json.dumps) | st.text(max_size=40), min_size=1, max_size=5))
def test_malformed_trace_like_files_never_crash(file_lines):
    path = _write("\n".join(['{"v": 1, "seq": 0, "type": "hello"}', *file_lines]))
    try:
        try:
            load_workload(path)
        except WorkloadError:
            pass
    finally:
        path.unlink()
