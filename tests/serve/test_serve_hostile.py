"""engine serve against a hostile client: a real server process, real sockets (issue 25).

Each test is one way a client used to hang, flood or fool the server: bodies too big to
read, keys checked too late, prompts that stall the event loop, lists that slow every
step, coerced types, tracebacks for odd input, connections that never finish.
"""

from __future__ import annotations

import json
import resource
import socket
import time
from pathlib import Path

import httpx
import pytest
from test_serve_cli import model_dir, start  # noqa: F401 - the fixture and the launcher are shared

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ("--api-key", KEY, "--max-request-bytes", "64KiB", "--header-timeout", "1", "--body-timeout", "2",
          "--timeout-keep-alive", "1", "--max-waiting", "8", "--max-num-seqs", "4", "--send-timeout", "2")


def _serving(path: Path):
    """A server with ``LIMITS`` for the module's tests, stopped after them."""
    proc, url = start(path, *LIMITS)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    yield from _serving(model_dir)


def post(url: str, path: str, body: object, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=30, **kwargs)


def envelope(response: httpx.Response, status: int, param: object = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param != "any":
        assert error["param"] == param, error
    return error


def raw_exchange(url: str, data: bytes, timeout: float = 10) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                break
        return b"".join(chunks)


# --- bounded work before admission -----------------------------------------------------------------------------------


def test_an_oversize_body_is_413_while_it_is_read_declared_or_chunked(server):
    url, _ = server
    envelope(post(url, "/v1/completions", {"prompt": "x" * 70_000}), 413)

    def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(100):
            yield b" " * 4096
    response = httpx.post(url + "/v1/completions", content=chunked(), headers=AUTH, timeout=30)
    assert "more" not in response.text
    envelope(response, 413)


def test_the_api_key_is_checked_before_the_body_is_read(server):
    url, _ = server
    # headers announce 1 GB and no byte of it is sent: a server that reads the body first hangs here
    head = raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000000000\r\nAuthorization: Bearer wrong\r\n\r\n", timeout=5)
    assert head.startswith(b"HTTP/1.1 401"), head


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing_and_health_stays_fast(server):
    url, _ = server
    started = time.perf_counter()
    error = envelope(post(url, "/v1/completions", {"prompt": "abc " * 15_000}), 400, "prompt")
    assert "characters" in error["message"] and time.perf_counter() - started < 2
    envelope(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "abc " * 15_000}]}), 400,
             "messages")
    assert httpx.get(url + "/health", timeout=2).status_code == 200


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ({"prompt": "x", "stop": ["x" * 300]}, "stop", "256"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ({"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias", "outside"),
    ({"prompt": ["x"] * 257}, "prompt", "at most 256"),
    ({"prompt": "x", "n": 16}, "n", "--max-waiting"),
])
def test_every_client_controlled_list_has_a_cap(server, body, param, words):
    error = envelope(post(server[0], "/v1/completions", body), 400, param)
    assert words in error["message"], error


def test_too_many_chat_messages_are_refused(server):
    messages = [{"role": "user", "content": "x"}] * 1025
    envelope(post(server[0], "/v1/chat/completions", {"messages": messages}), 400, "messages")


# --- strict validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"temperature": "0"}, "temperature"),
    ({"temperature": False}, "temperature"),
    ({"n": "2"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": True}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"max_token": 8}, "max_token"),
    ({"stream_options": {"include_usage": True, "extra": 1}, "stream": True}, "stream_options.extra"),
])
def test_wrong_types_and_unknown_fields_are_400_naming_the_field(server, extra, param):
    error = envelope(post(server[0], "/v1/completions", {"prompt": "x", "max_tokens": 2, **extra}), 400, param)
    assert error["type"] == "invalid_request_error"


def test_token_id_prompts_must_be_integers_not_booleans(server):
    envelope(post(server[0], "/v1/completions", {"prompt": [True, False]}), 400, "prompt")


def test_null_means_not_set(server):
    body = {"prompt": "x", "max_tokens": None, "temperature": None, "stop": None, "n": None, "seed": None}
    response = post(server[0], "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 16  # completions' default max_tokens


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", None),
    ("/v1/completions", '{"prompt": "x", "max_tokens": ' + "9" * 50 + "}", "max_tokens"),
    ("/v1/completions", "{not json", None),
    ("/v1/completions", '["a", "list"]', None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
])
def test_odd_bodies_answer_400_in_the_envelope(server, path, body, param):
    response = httpx.post(server[0] + path, content=body, headers={**AUTH, "Content-Type": "application/json"})
    envelope(response, 400, param)


def test_a_paired_surrogate_escape_is_ordinary_text(server):
    response = httpx.post(server[0] + "/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                          content='{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert response.status_code == 200, response.text


def test_unknown_routes_methods_and_the_docs_answer_in_the_envelope(server):
    url, _ = server
    envelope(httpx.get(url + "/v1/nothing-here", headers=AUTH), 404)
    envelope(httpx.get(url + "/v1/completions", headers=AUTH), 405)
    for path in ("/docs", "/redoc", "/openapi.json"):
        envelope(httpx.get(url + path, headers=AUTH), 404)


def test_the_server_log_has_no_traceback_after_all_that(server):
    url, proc = server
    assert httpx.get(url + "/health").status_code == 200
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err[-3000:]


# --- connections (their own server: the one above has stopped) -------------------------------------------------------


@pytest.fixture(scope="module")
def fresh(model_dir):  # noqa: F811
    yield from _serving(model_dir)


def test_a_slowloris_and_a_silent_connection_are_closed(fresh):
    url, _ = fresh
    host, port = url.removeprefix("http://").split(":")
    silent = socket.create_connection((host, int(port)))
    slow = socket.create_connection((host, int(port)))
    silent.settimeout(10)
    slow.settimeout(0.5)
    started = time.monotonic()
    closed_after = None
    for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
        try:
            slow.sendall(bytes([byte]))
            if slow.recv(1) == b"":
                closed_after = time.monotonic() - started
                break
        except TimeoutError:
            continue
        except OSError:
            closed_after = time.monotonic() - started
            break
    assert closed_after is not None and closed_after < 5, closed_after
    assert silent.recv(1) == b""  # closed by the server, well within the 10 s
    silent.close()
    slow.close()
    assert httpx.get(url + "/health", timeout=2).status_code == 200


def test_a_body_that_never_finishes_is_408(fresh):
    url, _ = fresh
    head = raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n{\"pro",
                        timeout=10)
    assert head.startswith(b"HTTP/1.1 408"), head


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("pagedkv:num_requests_running", "pagedkv:kv_cache_usage_perc"))}


ESTABLISHED = "01"  # the connection states of /proc/net/tcp (linux/tcp_states.h, in hex)


def _server_side_state(client: socket.socket) -> str | None:
    """The state of the server's end of ``client``'s connection, from /proc/net/tcp (None: gone)."""
    ours, theirs = client.getsockname()[1], client.getpeername()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if int(local.split(":")[1], 16) == theirs and int(remote.split(":")[1], 16) == ours:
            return state
    return None


def _wait_until_the_server_closes(client: socket.socket, deadline: float) -> None:
    """Wait, without reading, until the server has closed its end of ``client``'s connection."""
    while time.monotonic() < deadline and _server_side_state(client) == ESTABLISHED:
        time.sleep(0.2)

def test_a_client_that_stops_reading_a_stream_is_cut_off_and_its_blocks_freed(fresh):
    url, _ = fresh
    host, port = url.removeprefix("http://").split(":")
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # a full receive window within a few chunks
    reader.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)  # keeps the server's kernel send buffer small
    reader.connect((host, int(port)))
    assert _server_side_state(reader) == ESTABLISHED  # (what the wait below watches)
    body = json.dumps({"prompt": "a", "max_tokens": 500, "n": 2, "logprobs": 5, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 30
    while _gauges(url)["pagedkv:num_requests_running"] == 0:  # the stream has started
        assert time.monotonic() < deadline
        time.sleep(0.1)
    other = post(url, "/v1/completions", {"prompt": "b", "max_tokens": 4})  # meanwhile, others are served
    assert other.status_code == 200, other.text
    deadline = time.monotonic() + 120
    while (gauges := _gauges(url))["pagedkv:num_requests_running"] > 0:
        assert time.monotonic() < deadline, gauges
        time.sleep(0.2)
    # not reading until the server has cut the connection: its stall clock restarts whenever the kernel takes a
    # few more bytes (the send buffer grows for a while), so a fixed wait past --send-timeout can be too short
    _wait_until_the_server_closes(reader, deadline=time.monotonic() + 60)
    assert _gauges(url)["pagedkv:kv_cache_usage_perc"] == 0.0
    reader.settimeout(10)
    received = b""
    try:
        while chunk := reader.recv(65536):
            received += chunk
    except OSError:
        pass
    reader.close()
    assert received.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in received, len(received)  # cut off, not finished late once the client read again
    assert post(url, "/v1/completions", {"prompt": "c", "max_tokens": 4}).status_code == 200


def test_the_cut_off_is_one_log_line_without_a_traceback(fresh):
    url, proc = fresh
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err[-3000:]
    assert err.count("accepted no response bytes") == 1, err[-3000:]


# --- out of file descriptors (its own server, under a low ulimit -n) -------------------------------------------------


def _few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def test_at_its_descriptor_limit_the_server_sheds_silent_connections_and_keeps_answering(model_dir):  # noqa: F811
    proc, url = start(model_dir, "--header-timeout", "8", "--timeout-keep-alive", "8", preexec_fn=_few_descriptors)
    host, port = url.removeprefix("http://").split(":")
    silent = []
    try:
        with httpx.Client(base_url=url, timeout=5) as kept:
            assert kept.get("/health").status_code == 200  # a connection opened before the flood
            for _ in range(100):  # more than the server has descriptors for
                silent.append(socket.create_connection((host, int(port))))
            slowest = 0.0
            for _ in range(10):
                started = time.monotonic()
                assert kept.get("/health").status_code == 200
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.05)
            assert slowest < 1.0, slowest
        started = time.monotonic()  # a new client gets in well before the header deadline (8 s) frees anything
        assert httpx.get(url + "/health", timeout=4).status_code == 200
        assert time.monotonic() - started < 4
        silent[0].settimeout(2)
        assert silent[0].recv(1) == b""  # the oldest silent connection was closed to make room
    finally:
        for sock in silent:
            sock.close()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err[-3000:]
    assert "out of file descriptors" in err, err[-3000:]  # one warning line per 10 s
