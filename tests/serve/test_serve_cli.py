"""`engine serve` as a process: telemetry to a monitor, and a clean stop on SIGTERM / SIGINT."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedkv.serve.testing import byte_level_tokenizer
from pagedkv.testing import tiny_llama


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tokenizer = byte_level_tokenizer()
    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start(model_dir: Path, *extra: str, preexec_fn: Any = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    engine = Path(sys.executable).with_name("engine")
    proc = subprocess.Popen(
        [str(engine), "serve", "--model", str(model_dir), "--port", str(port), "--device", "cpu", "--num-blocks",
         "256", "--block-size", "8", "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "engine serve did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def long_stream(url: str, max_tokens: int = 450) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(base_url=url, timeout=60)
    body = {"prompt": "a", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    return client, response


def test_sigterm_ends_in_flight_streams_cleanly_and_exits_0(model_dir):
    proc, url = start(model_dir, "--shutdown-timeout", "0")
    try:
        client, response = long_stream(url)
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
        client.close()
        assert rest[-1] == "data: [DONE]"
        finishes = [json.loads(x[5:])["choices"][0]["finish_reason"] for x in rest[:-1]]
        assert finishes[-1] == "abort" and not any(finishes[:-1])  # ended at once, with a proper last chunk
        assert proc.wait(60) == 0
        _, stderr = proc.communicate()
        assert "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_telemetry_from_a_running_server_then_sigint_lets_in_flight_requests_finish(model_dir):
    telemetry_port = free_port()
    proc, url = start(model_dir, "--telemetry", f"tcp:127.0.0.1:{telemetry_port}", "--shutdown-timeout", "120")
    try:
        with socket.create_connection(("127.0.0.1", telemetry_port), timeout=30) as sock:
            reader = sock.makefile("r")
            hello = json.loads(reader.readline())
            assert hello["type"] == "hello" and hello["num_blocks"] == 256
            answer = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
            assert answer.status_code == 200
            kinds = set()
            deadline = time.monotonic() + 30
            while "delta" not in kinds and time.monotonic() < deadline:
                kinds.add(json.loads(reader.readline())["type"])
            assert "delta" in kinds  # the request's blocks and state changes reach the monitor

        client, response = long_stream(url)
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        proc.send_signal(signal.SIGINT)
        try:
            refused = httpx.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=10)
            assert refused.status_code == 503
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            # the listening socket is already closed, or it closed between the kernel's accept and the app's
            # read and reset or closed the connection: refused as well (the stream's end and the exit code still count)
            pass
        rest = [line for line in lines if line.startswith("data:")]
        client.close()
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"  # it ran to its end
        assert proc.wait(60) == 0
        _, stderr = proc.communicate()
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_model_answers_to_the_argument_as_given_and_to_its_basename(model_dir):
    proc, url = start(model_dir)
    try:
        as_given = str(model_dir)
        listed = [card["id"] for card in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
        assert listed == [as_given, model_dir.name]  # vLLM's default name first
        for name in listed:
            answer = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                                timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == as_given
        assert httpx.get(url + f"/v1/models/{model_dir.name}", timeout=10).status_code == 200
        other = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 2},
                           timeout=60)
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    finally:
        proc.terminate()
        proc.wait(60)


def test_default_served_names():
    from pagedkv.cli.serve import default_served_names

    assert default_served_names("/models/tiny/") == ["/models/tiny/", "tiny"]
    assert default_served_names("org/Model-1B") == ["org/Model-1B", "Model-1B"]
    assert default_served_names("tiny") == ["tiny"]
