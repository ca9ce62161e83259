"""A request's own chat template: refused unless trusted (vLLM's --trust-request-chat-template), then sandboxed.

Issue 42 row 1: a 90-byte nested loop sent as ``chat_template`` held the tokenizer thread for ~40 minutes
(every other request timed out, SIGTERM was not obeyed) and ``{{ 'x' * 300000000 }}`` took the server's
RSS from 343 to 1,479 MiB. Now an untrusted server answers 400 naming the field, and a trusting one renders
in a worker process with a time, length and memory limit while everything else keeps flowing.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

from serve_helpers import running_server, tiny_chat_engine  # noqa: E402
from test_serve_cli import model_dir, start  # noqa: E402, F401 - the fixture and the launcher are shared

from pagedkv.serve.http.template_sandbox import DEFAULT_TIME_LIMIT_S  # noqa: E402
from pagedkv.serve.testing import CHAT_TEMPLATE, byte_level_tokenizer  # noqa: E402

NESTED_LOOPS = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"  # the issue's
SILENT_LOOPS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"  # writes nothing
HUGE_STRING = "{{ 'x' * 300000000 }}"
MESSAGES = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def untrusted(tokenizer):
    with running_server(tiny_chat_engine(tokenizer)) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def trusted(tokenizer):
    with running_server(tiny_chat_engine(tokenizer), trust_request_chat_template=True) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0, **fields}


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status")


# --- untrusted (the default): refused by name --------------------------------------------------------------------


@pytest.mark.parametrize(("path", "field", "body"), [
    ("/v1/chat/completions", "chat_template", chat(chat_template="{{ messages }}")),
    ("/tokenize", "chat_template", {"messages": MESSAGES, "chat_template": "{{ messages }}"}),
    ("/tokenize", "chat_template_kwargs", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "x"}}),
])
def test_a_request_template_is_refused_naming_the_field_unless_trusted(untrusted, path, field, body):
    message = refused(untrusted.post(path, json=body), field)
    assert "--trust-request-chat-template" in message
    assert untrusted.post("/v1/chat/completions", json=chat()).status_code == 200  # the model's template still serves


# --- trusted: rendered as the model's template would be, in the sandbox ----------------------------------------------


def test_a_trusted_request_template_renders_as_the_tokenizer_does(trusted, tokenizer):
    template = "{{ bos_token }}" + CHAT_TEMPLATE + "{{ suffix }}"
    body = {"messages": MESSAGES + [{"role": "assistant", "content": "Hi, I am "}], "chat_template": template,
            "chat_template_kwargs": {"suffix": "!"}, "add_generation_prompt": False, "continue_final_message": True}
    ids = trusted.post("/tokenize", json=body).json()["tokens"]
    expected = tokenizer.apply_chat_template(body["messages"], chat_template=template, tokenize=False,
                                             continue_final_message=True, suffix="!")
    assert tokenizer.decode(ids) == expected and expected.endswith("Hi, I am ")
    answer = trusted.post("/v1/chat/completions", json=chat(chat_template=template, return_token_ids=True))
    assert answer.status_code == 200, answer.text
    assert tokenizer.decode(answer.json()["prompt_token_ids"]) == tokenizer.apply_chat_template(
        MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_a_failing_request_template_is_a_400_naming_it(trusted):
    message = refused(trusted.post("/v1/chat/completions", json=chat(chat_template="{{ raise_exception('nope') }}")),
                      "chat_template")
    assert "nope" in message
    refused(trusted.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{% for %}"}), "chat_template")


def test_a_template_looping_for_ever_is_stopped_while_other_requests_flow(trusted):
    answers = {}

    def hostile() -> None:
        started = time.monotonic()
        answers["hostile"] = trusted.post("/v1/chat/completions", json=chat(chat_template=SILENT_LOOPS))
        answers["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=hostile)
    thread.start()
    time.sleep(0.3)
    health = []
    while thread.is_alive():
        started = time.monotonic()
        assert trusted.get("/health").status_code == 200
        health.append(time.monotonic() - started)
        assert trusted.post("/v1/chat/completions", json=chat()).status_code == 200  # the model's template
        time.sleep(0.05)
    thread.join()
    assert "did not finish rendering" in refused(answers["hostile"], "chat_template")
    assert answers["seconds"] < DEFAULT_TIME_LIMIT_S + 10
    assert health and max(health) < 1.0, health
    ok = trusted.post("/v1/chat/completions", json=chat(chat_template=CHAT_TEMPLATE))  # a fresh worker renders
    assert ok.status_code == 200, ok.text
    started = time.monotonic()  # the loop writes an x per turn: it stops at the context's length
    assert "characters" in refused(trusted.post("/v1/chat/completions", json=chat(chat_template=NESTED_LOOPS)),
                                   "chat_template")
    assert time.monotonic() - started < DEFAULT_TIME_LIMIT_S


def test_a_huge_string_or_text_does_not_grow_the_server(trusted):
    trusted.post("/v1/chat/completions", json=chat(chat_template=CHAT_TEMPLATE))  # the worker is up
    before = rss_mib()
    message = refused(trusted.post("/v1/chat/completions", json=chat(chat_template=HUGE_STRING)), "chat_template")
    assert "memory" in message or "characters" in message, message
    long_text = "{% for a in range(99999) %}{{ messages[0].content }}{% endfor %}"  # 1.1 M characters
    assert "characters" in refused(trusted.post("/tokenize", json={"messages": MESSAGES, "chat_template": long_text}),
                                   "chat_template")
    assert rss_mib() - before < 50, (before, rss_mib())


def test_sigterm_is_obeyed_during_a_hostile_render_and_the_worker_goes_too(model_dir):  # noqa: F811
    proc, url = start(model_dir, "--trust-request-chat-template")
    try:
        def hostile() -> None:
            try:
                httpx.post(url + "/v1/chat/completions", json=chat(chat_template=SILENT_LOOPS), timeout=30)
            except httpx.HTTPError:
                pass
        thread = threading.Thread(target=hostile, daemon=True)
        thread.start()
        worker = _child_pids(proc.pid, within_s=10)
        assert worker, "no sandbox worker was started"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - started < DEFAULT_TIME_LIMIT_S + 8 and proc.returncode == 0, err
        assert "Traceback" not in err, err
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in worker), "the sandbox worker outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def _child_pids(parent: int, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    status = (entry / "status").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if f"\nPPid:\t{parent}\n" in status and b"template_worker" in cmdline:
                    children.append(int(entry.name))
        if children:
            return children
        time.sleep(0.05)
    return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited
