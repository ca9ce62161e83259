"""A client that half-closes its socket after sending a request (``shutdown(SHUT_WR)``) still gets its answer.

uvicorn's protocol lets asyncio close the transport on EOF, so such a client (``curl`` reading a body from a
pipe, ``nc -N``, some proxies) used to get 0 bytes. The EOF only says the client will send nothing more.
"""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("uvicorn")

from serve_helpers import running_server, tiny_chat_engine  # noqa: E402

from pagedkv.serve.testing import byte_level_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def url():
    with running_server(tiny_chat_engine(byte_level_tokenizer())) as (base, _):
        yield base


def half_closed_exchange(base: str, request: bytes, timeout: float = 30) -> bytes:
    """Send ``request``, shut the write side, read until the server closes."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def http_post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def test_a_half_closed_client_gets_its_full_answer(url):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    reply = half_closed_exchange(url, http_post("/v1/completions", body))
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:200]
    answer = json.loads(payload)
    assert answer["choices"][0]["finish_reason"] in ("length", "stop") and answer["usage"]["completion_tokens"] >= 1


def test_a_half_closed_client_gets_its_whole_stream(url):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0, "stream": True}
    reply = half_closed_exchange(url, http_post("/v1/completions", body))
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert reply.rstrip().endswith(b"data: [DONE]") or b"data: [DONE]" in reply, reply[-200:]


def test_a_half_closed_client_with_an_unfinished_request_is_closed_without_an_answer(url):
    """EOF in the middle of a body is a client that left: nothing to answer, the connection just closes."""
    request = http_post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 8})
    assert half_closed_exchange(url, request[:-5], timeout=10) == b""


def test_a_half_closed_idle_connection_is_closed(url):
    assert half_closed_exchange(url, b"", timeout=10) == b""
